# Decides whether the CUDA backend is built (ATTNGRAD_CUDA = AUTO | ON | OFF) and, when it is, enables
# the CUDA language for sm_90a and sm_100a machine code plus compute_100a PTX.
set(ATTNGRAD_HAVE_CUDA OFF)
if(NOT ATTNGRAD_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # 90a-real: Hopper machine code (wgmma/TMA allowed); 100a-real: B200; 100a-virtual: PTX.
      set(CMAKE_CUDA_ARCHITECTURES "90a-real;100a-real;100a-virtual")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    # CMake before 3.27 (Debian 12 has 3.25) marks CUDA::nvToolsExt deprecated without checking that
    # the target exists, and CUDA 13 has no libnvToolsExt (only the header-only nvtx3): the configure
    # fails. An empty target of that name lets it pass; nothing here links it.
    if(CMAKE_VERSION VERSION_LESS 3.27 AND NOT TARGET CUDA::nvToolsExt)
      add_library(CUDA::nvToolsExt INTERFACE IMPORTED GLOBAL)
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(ATTNGRAD_HAVE_CUDA ON)
  elseif(ATTNGRAD_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ATTNGRAD_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  endif()
endif()
message(STATUS "attngrad: CUDA backend ${ATTNGRAD_HAVE_CUDA}")
