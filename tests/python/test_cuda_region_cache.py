"""attngrad.cuda_regions.CudaRegionCache without a GPU: the driver's answers (which allocation holds
an address, its IPC handle) and the client's RegisterRegion/UnregisterRegion are stand-ins that
record what the cache asks. One region per GPU allocation, whatever the tensors in it; an
allocation whose address range another (newer buffer id) reuses is unregistered; the least recently
used goes first past the capacity; close() unregisters everything; a tensor running past its
allocation's end is refused. (With a GPU, test_cuda_ipc.py runs the real driver and server.)"""
from __future__ import annotations

import unittest

import attngrad_testing  # noqa: F401 - puts client/python on sys.path

from attngrad import cuda_regions

MiB = 1 << 20


class FakeTensor:
    """What the cache reads of a torch tensor: data_ptr, numel, element_size."""

    def __init__(self, address: int, numel: int, element_size: int = 4):
        self.address, self.count, self.size = address, numel, element_size

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.count

    def element_size(self) -> int:
        return self.size


class FakeDriver:
    """Allocations by address range; every live one has a buffer id (never reused)."""

    def __init__(self):
        self.allocations = []
        self.next_id = 1
        self.handles_asked = 0

    def allocate(self, base: int, size: int, device: int = 0) -> cuda_regions.Allocation:
        allocation = cuda_regions.Allocation(device, base, size, self.next_id)
        self.next_id += 1
        self.allocations = [a for a in self.allocations
                            if not (a.device == device and a.base < base + size
                                    and base < a.base + a.size)]
        self.allocations.append(allocation)
        return allocation

    def locate(self, address: int) -> cuda_regions.Allocation:
        for allocation in self.allocations:
            if allocation.base <= address < allocation.base + allocation.size:
                return allocation
        raise ValueError(f"no allocation at {address:#x}")

    def ipc_handle(self, allocation: cuda_regions.Allocation) -> bytes:
        self.handles_asked += 1
        return allocation.buffer_id.to_bytes(8, "little") * 8


class Server:
    """RegisterRegion / UnregisterRegion: the live regions by id."""

    def __init__(self):
        self.live = {}
        self.next_region = 100

    def register(self, handle: bytes, device: int, offset: int, size: int) -> int:
        self.next_region += 1
        self.live[self.next_region] = (handle, device, offset, size)
        return self.next_region

    def unregister(self, region: int) -> None:
        del self.live[region]


class CudaRegionCacheTest(unittest.TestCase):
    def setUp(self):
        self.driver = FakeDriver()
        self.server = Server()
        self.cache = cuda_regions.CudaRegionCache(
            self.server.register, self.server.unregister, capacity=3,
            locate=self.driver.locate, ipc_handle=self.driver.ipc_handle)

    def test_one_region_per_allocation_whatever_the_tensors_in_it(self):
        segment = self.driver.allocate(0x7000_0000, 20 * MiB)
        first = self.cache.slice_of(FakeTensor(0x7000_0000 + 512, 1024))
        second = self.cache.slice_of(FakeTensor(0x7000_0000 + 4 * MiB, 3 * MiB // 4))
        self.assertEqual(first[0], second[0])
        self.assertEqual(first[1:], (512, 4096))
        self.assertEqual(second[1:], (4 * MiB, 3 * MiB))
        # The whole allocation, from its base, on its device.
        self.assertEqual(list(self.server.live.values()),
                         [(self.driver.ipc_handle(segment), 0, 0, 20 * MiB)])
        for _ in range(5):  # later calls: the driver lookup only
            self.assertEqual(self.cache.slice_of(FakeTensor(0x7000_0000, 16))[0], first[0])
        self.assertEqual(self.driver.handles_asked, 2)  # one registration (and the check above)
        self.assertEqual(len(self.cache), 1)

    def test_a_freed_allocation_whose_addresses_are_reused_is_unregistered(self):
        self.driver.allocate(0x7000_0000, 2 * MiB)
        old = self.cache.slice_of(FakeTensor(0x7000_0000, 256))[0]
        other = self.driver.allocate(0x9000_0000, 2 * MiB)
        kept = self.cache.slice_of(FakeTensor(other.base, 256))[0]
        # The first allocation freed (torch.cuda.empty_cache()) and a new one at the same base.
        self.driver.allocate(0x7000_0000, 4 * MiB)
        new = self.cache.slice_of(FakeTensor(0x7000_0000 + 3 * MiB, 256))
        self.assertNotEqual(new[0], old)
        self.assertEqual(new[1], 3 * MiB)
        self.assertEqual(sorted(self.server.live), sorted([kept, new[0]]))
        self.assertEqual(self.server.live[new[0]][3], 4 * MiB)

    def test_the_least_recently_used_goes_first_past_the_capacity(self):
        bases = [0x1000_0000 * (i + 1) for i in range(4)]
        for base in bases:
            self.driver.allocate(base, 2 * MiB)
        regions = [self.cache.slice_of(FakeTensor(base, 4))[0] for base in bases[:3]]
        self.cache.slice_of(FakeTensor(bases[0], 4))  # used again: the second is the oldest now
        fourth = self.cache.slice_of(FakeTensor(bases[3], 4))[0]
        self.assertEqual(sorted(self.server.live), sorted([regions[0], regions[2], fourth]))
        self.assertEqual(len(self.cache), 3)
        self.assertEqual((self.cache.registered, self.cache.unregistered), (4, 1))

    def test_close_unregisters_everything(self):
        for base in (0x1000_0000, 0x2000_0000):
            self.driver.allocate(base, 2 * MiB, device=1)
            self.cache.slice_of(FakeTensor(base, 4))
        self.assertEqual({device for _, device, _, _ in self.server.live.values()}, {1})
        self.cache.close()
        self.assertEqual(self.server.live, {})
        self.assertEqual(len(self.cache), 0)
        self.assertEqual((self.cache.registered, self.cache.unregistered), (2, 2))

    def test_the_segments_held_at_the_first_call_are_registered_once(self):
        bases = [0x1000_0000, 0x2000_0000]
        for base in bases:
            self.driver.allocate(base, 2 * MiB)
        asked = []

        def segments():
            asked.append(True)
            return bases + [0x5000_0000]  # the last: memory the driver cannot place (skipped)

        self.assertEqual(self.cache.register_segments_once(0, segments), 2)
        self.assertEqual(self.cache.register_segments_once(0, segments), 0)
        self.assertEqual(len(asked), 1)
        self.assertEqual(sorted(size for _, _, _, size in self.server.live.values()),
                         [2 * MiB, 2 * MiB])
        region = self.cache.slice_of(FakeTensor(bases[1] + 4096, 4))[0]  # no new registration
        self.assertIn(region, self.server.live)
        self.assertEqual(self.cache.registered, 2)

    def test_a_tensor_past_its_allocation_is_refused(self):
        self.driver.allocate(0x7000_0000, 2 * MiB)
        with self.assertRaisesRegex(ValueError, "past the end"):
            self.cache.slice_of(FakeTensor(0x7000_0000 + 2 * MiB - 8, 4))
        self.assertEqual(self.server.live, {})


if __name__ == "__main__":
    unittest.main()
