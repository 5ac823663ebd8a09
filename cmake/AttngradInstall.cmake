# What cmake --install puts in place besides the targets' own install() rules (kernels/, proto/,
# client/, server/): the CMake package config of find_package(attngrad CONFIG) with its version
# file and exported targets, and attngrad.pc for the C ABI.
#
#   attngrad::kernels  libattngrad.so, the C ABI (attngrad/attngrad.h) and the C++ API
#   attngrad::client   the C++ client (attngrad/client.h; a static library with attngrad::wire,
#                      attngrad::common and attngrad::proto); only where the server was built
#                      (ATTNGRAD_BUILD_SERVER)
#
# The config finds the client's dependencies itself (gRPC, protobuf, Abseil, Threads), so a consumer
# calls find_package(attngrad) alone. libattngrad.so carries its own (OpenBLAS, the CUDA runtime) as
# shared-library dependencies: linking it needs none of them found.
include(CMakePackageConfigHelpers)

set(ATTNGRAD_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/attngrad CACHE STRING
    "Where cmake --install puts attngradConfig.cmake (relative to the prefix)")
mark_as_advanced(ATTNGRAD_INSTALL_CMAKEDIR)

install(EXPORT attngradTargets NAMESPACE attngrad:: FILE attngradTargets.cmake
        DESTINATION ${ATTNGRAD_INSTALL_CMAKEDIR} COMPONENT library)

# Read by the config template.
set(ATTNGRAD_PACKAGE_HAS_CLIENT ${ATTNGRAD_BUILD_SERVER})
set(ATTNGRAD_PACKAGE_HAS_CUDA ${ATTNGRAD_HAVE_CUDA})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/attngradConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/attngradConfig.cmake
  INSTALL_DESTINATION ${ATTNGRAD_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/attngradConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/attngradConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/attngradConfigVersion.cmake
        DESTINATION ${ATTNGRAD_INSTALL_CMAKEDIR} COMPONENT library)

# attngrad.pc: relocatable (paths relative to the .pc file's own directory), so that an install
# under another --prefix than the configured one, or a DESTDIR, still gives the right paths.
set(ATTNGRAD_PKGCONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(ATTNGRAD_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(ATTNGRAD_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
  set(ATTNGRAD_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH attngrad_pc_up /prefix/${ATTNGRAD_PKGCONFIG_DIR} /prefix)
  string(REGEX REPLACE "/$" "" attngrad_pc_up "${attngrad_pc_up}")
  set(ATTNGRAD_PC_PREFIX "\${pcfiledir}/${attngrad_pc_up}")
  set(ATTNGRAD_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(ATTNGRAD_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/attngrad.pc.in ${CMAKE_CURRENT_BINARY_DIR}/attngrad.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/attngrad.pc DESTINATION ${ATTNGRAD_PKGCONFIG_DIR}
        COMPONENT library)
