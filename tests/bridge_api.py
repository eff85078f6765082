"""csrc/cuda/bridge_api.h in ctypes, for testing the C interface the bridge uses.

Mirrors the header member by member; test_bridge_api.py checks the sizes
against a C compiler's view of the same header, so the two cannot drift.
"""
from __future__ import annotations

import ctypes as c

from pyalloc import _C

OK, OUT_OF_MEMORY, INVALID, ERROR = 0, 1, 2, 3
OWNER_POOLS, OWNER_NONE, OWNER_OTHER = 0, 1, 2
VERSION = 2
ACTIONS = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom",
)


class OomInfo(c.Structure):
    _fields_ = ([(n, c.c_uint64) for n in ("requested", "allocated", "reserved", "device_free", "device_total")]
                + [("rejected", c.c_int)])


class Stat(c.Structure):
    _fields_ = [(n, c.c_int64) for n in ("current", "peak", "allocated", "freed")]


class StatArray(c.Structure):
    _fields_ = [("all", Stat), ("small_pool", Stat), ("large_pool", Stat)]


STAT_ARRAYS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
)
COUNTERS = (
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
    "num_device_free", "num_oom_rejections", "max_split_size",
)


class DeviceStats(c.Structure):
    _fields_ = (
        [(n, StatArray) for n in STAT_ARRAYS]
        + [("oversize_allocations", Stat), ("oversize_segments", Stat)]
        + [(n, c.c_int64) for n in COUNTERS]
    )

    def as_dict(self) -> dict:
        """The keys of torch.cuda.memory_stats()."""
        out = {}
        for name in STAT_ARRAYS:
            array = getattr(self, name)
            for pool in ("all", "small_pool", "large_pool"):
                stat = getattr(array, pool)
                for field in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{field}"] = getattr(stat, field)
        for name in ("oversize_allocations", "oversize_segments"):
            stat = getattr(self, name)
            for field in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{field}"] = getattr(stat, field)
        for name in COUNTERS:
            out[name] = getattr(self, name)
        return out


class BlockInfo(c.Structure):
    _fields_ = [
        ("size", c.c_uint64), ("requested_size", c.c_uint64), ("allocated", c.c_int),
        ("active", c.c_int), ("context", c.c_uint64),
    ]


class SegmentInfo(c.Structure):
    _fields_ = [
        ("device", c.c_int), ("address", c.c_uint64), ("total_size", c.c_uint64),
        ("allocated_size", c.c_uint64), ("active_size", c.c_uint64),
        ("requested_size", c.c_uint64), ("stream", c.c_void_p), ("is_large", c.c_int),
        ("is_expandable", c.c_int), ("pool_id", c.c_uint64 * 2),
        ("registration_counter", c.c_int64),  # appended: read where segment_info_size covers it
    ]


class TraceEntry(c.Structure):
    _fields_ = [
        ("action", c.c_int), ("addr", c.c_uint64), ("size", c.c_uint64), ("stream", c.c_void_p),
        ("time_us", c.c_int64), ("context", c.c_uint64), ("pool_id", c.c_uint64 * 2),
    ]


class MemoryUsage(c.Structure):
    _fields_ = [("device", c.c_int), ("size", c.c_uint64), ("allocated", c.c_uint64), ("reserved", c.c_uint64)]


class LiveBlock(c.Structure):
    _fields_ = [("ptr", c.c_uint64), ("size", c.c_uint64), ("stream", c.c_void_p)]


SEGMENT_FN = c.CFUNCTYPE(None, c.c_void_p, c.POINTER(SegmentInfo), c.POINTER(BlockInfo), c.c_size_t)
TRACE_FN = c.CFUNCTYPE(None, c.c_void_p, c.POINTER(TraceEntry))
VALUE_FN = c.CFUNCTYPE(None, c.c_void_p, c.c_uint64)
FILTER_FN = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_void_p)
LIVE_BLOCK_FN = c.CFUNCTYPE(None, c.c_void_p, c.POINTER(LiveBlock))
POOL_STAT_FN = c.CFUNCTYPE(None, c.c_void_p, c.c_uint64, c.c_uint64, c.POINTER(StatArray))
SEGMENT_EVENT_FN = c.CFUNCTYPE(None, c.c_void_p, c.c_int, c.c_int, c.c_uint64, c.c_uint64, c.POINTER(c.c_uint64))
SOURCE_ALLOC_FN = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_int, c.c_uint64, c.POINTER(c.c_void_p))
SOURCE_FREE_FN = c.CFUNCTYPE(None, c.c_void_p, c.c_int, c.c_void_p, c.c_uint64)
FREE_MEMORY_FN = c.CFUNCTYPE(c.c_int, c.c_void_p)
u64, i32 = c.c_uint64, c.c_int


class Api(c.Structure):
    _fields_ = [
        ("version", c.c_uint32),
        ("size", c.c_uint32),
        ("pyalloc_version", c.c_char_p),
        ("last_error", c.CFUNCTYPE(c.c_char_p)),
        ("malloc", c.CFUNCTYPE(i32, i32, u64, c.c_void_p, u64, c.POINTER(c.c_void_p), c.POINTER(OomInfo))),
        ("free", c.CFUNCTYPE(i32, c.c_void_p, u64)),
        ("record_stream", c.CFUNCTYPE(i32, c.c_void_p, c.c_void_p)),
        ("base_alloc", c.CFUNCTYPE(c.c_void_p, c.c_void_p, c.POINTER(u64))),
        ("empty_cache", c.CFUNCTYPE(i32, i32)),
        ("set_memory_fraction", c.CFUNCTYPE(i32, i32, c.c_double)),
        ("memory_fraction", c.CFUNCTYPE(i32, i32, c.POINTER(c.c_double))),
        ("cache_info", c.CFUNCTYPE(i32, i32, c.POINTER(u64))),
        ("device_stats", c.CFUNCTYPE(i32, i32, c.POINTER(DeviceStats))),
        ("reset_peak_stats", c.CFUNCTYPE(i32, i32)),
        ("reset_accumulated_stats", c.CFUNCTYPE(i32, i32)),
        ("pool_reserved", c.CFUNCTYPE(i32, i32, POOL_STAT_FN, c.c_void_p)),
        ("snapshot", c.CFUNCTYPE(i32, i32, c.POINTER(u64), SEGMENT_FN, c.c_void_p)),
        ("history", c.CFUNCTYPE(i32, i32, TRACE_FN, c.c_void_p)),
        ("record_history", c.CFUNCTYPE(i32, i32, u64, i32)),
        ("contexts_in_use", c.CFUNCTYPE(i32, VALUE_FN, c.c_void_p)),
        ("begin_allocate_to_pool", c.CFUNCTYPE(i32, i32, u64, u64, FILTER_FN, c.c_void_p)),
        ("end_allocate_to_pool", c.CFUNCTYPE(i32, i32, u64, u64)),
        ("release_pool", c.CFUNCTYPE(i32, i32, u64, u64)),
        ("create_or_incref_pool", c.CFUNCTYPE(i32, i32, u64, u64)),
        ("pool_use_count", c.CFUNCTYPE(i32, i32, u64, u64, c.POINTER(i32))),
        ("pool_live_blocks", c.CFUNCTYPE(i32, i32, u64, u64, VALUE_FN, c.c_void_p)),
        ("pool_checkpoint", c.CFUNCTYPE(i32, i32, u64, u64, LIVE_BLOCK_FN, c.c_void_p)),
        ("pool_restore", c.CFUNCTYPE(i32, i32, u64, u64, c.POINTER(LiveBlock), u64, VALUE_FN,
                                     VALUE_FN, c.c_void_p)),
        ("init", c.CFUNCTYPE(i32, i32)),
        ("set_route", c.CFUNCTYPE(i32, i32)),
        ("settings", c.CFUNCTYPE(i32, c.c_char_p, u64)),
        # version 2
        ("record_stream_owned", c.CFUNCTYPE(i32, c.c_void_p, c.c_void_p, i32)),
        ("block_context", c.CFUNCTYPE(i32, c.c_void_p, c.POINTER(u64))),
        ("mark_capture", c.CFUNCTYPE(i32, i32, i32)),
        ("memory_usage", c.CFUNCTYPE(i32, i32, c.c_void_p, c.POINTER(MemoryUsage))),
        ("ipc_share", c.CFUNCTYPE(i32, c.c_void_p, c.c_char_p, u64, c.POINTER(u64), c.POINTER(u64))),
        ("ipc_open", c.CFUNCTYPE(i32, i32, c.c_char_p, u64, c.POINTER(c.c_void_p))),
        ("ipc_close", c.CFUNCTYPE(i32, c.c_void_p)),
        ("watch_segments", c.CFUNCTYPE(i32, SEGMENT_EVENT_FN, c.c_void_p)),
        ("snapshot_units", c.CFUNCTYPE(i32, i32, c.POINTER(u64), SEGMENT_FN, c.c_void_p)),
        ("create_or_incref_pool_with", c.CFUNCTYPE(i32, i32, u64, u64, SOURCE_ALLOC_FN, SOURCE_FREE_FN,
                                                   c.c_void_p)),
        ("set_free_memory_hook", c.CFUNCTYPE(i32, FREE_MEMORY_FN, c.c_void_p)),
        ("set_captures_marked", c.CFUNCTYPE(i32, i32)),
        ("record_stream_on", c.CFUNCTYPE(i32, c.c_void_p, c.c_void_p, i32, i32)),
        ("segment_info_size", c.c_uint64),
        ("set_pool_use_on_oom", c.CFUNCTYPE(i32, i32, u64, u64, i32)),
        ("set_pool_no_split", c.CFUNCTYPE(i32, i32, u64, u64)),
    ]


class BridgeApi:
    """The table of `version`, with Python-friendly wrappers for the tests."""

    def __init__(self, version: int = VERSION) -> None:
        lib = c.CDLL(_C.library_path())
        get = lib.pyalloc_bridge_api_get
        get.restype = c.POINTER(Api)
        get.argtypes = [c.c_uint32]
        self.get = get
        ptr = get(version)
        if not ptr:
            raise RuntimeError(f"pyalloc offers no bridge API of version {version}")
        self.pointer = ptr  # the table's address, as the bridge holds it
        self.table = ptr.contents

    def __getattr__(self, name):
        return getattr(self.table, name)

    def error(self) -> str:
        return self.table.last_error().decode()

    def malloc(self, size: int, device: int = 0, stream: int = 0, context: int = 0):
        """(status, pointer, OomInfo)"""
        out = c.c_void_p()
        oom = OomInfo()
        status = self.table.malloc(device, size, stream, context, c.byref(out), c.byref(oom))
        return status, out.value or 0, oom

    def memory_usage(self, ptr: int = 0, device: int = -1) -> MemoryUsage:
        out = MemoryUsage()
        assert self.table.memory_usage(device, ptr or None, c.byref(out)) == OK, self.error()
        return out

    def ipc_share(self, ptr: int):
        """(status, handle bytes, offset): what the bridge's shareIpcHandle gives PyTorch."""
        buf = c.create_string_buffer(256)
        length, offset = u64(), u64()
        status = self.table.ipc_share(ptr, buf, len(buf), c.byref(length), c.byref(offset))
        return status, buf.raw[:length.value] if status == OK else b"", offset.value

    def ipc_open(self, handle: bytes, device: int = 0):
        """(status, pointer): what the bridge's getIpcDevPtr maps."""
        out = c.c_void_p()
        status = self.table.ipc_open(device, handle, len(handle), c.byref(out))
        return status, out.value or 0

    def block_context(self, ptr: int) -> int:
        out = u64()
        assert self.table.block_context(ptr, c.byref(out)) == OK, self.error()
        return out.value

    def stats(self, device: int = 0) -> dict:
        s = DeviceStats()
        assert self.table.device_stats(device, c.byref(s)) == OK, self.error()
        return s.as_dict()

    def pool_reserved(self, device: int = 0) -> dict:
        """The keys torch 2.13 flattens reserved_bytes_by_private_pools into."""
        out = {}

        def on_pool(_user, id0, id1, reserved):
            r = reserved.contents
            for pool in ("all", "small_pool", "large_pool"):
                stat = getattr(r, pool)
                for field in ("current", "peak", "allocated", "freed"):
                    out[f"reserved_bytes_by_private_pools.{id0}_{id1}.{pool}.{field}"] = getattr(stat, field)

        assert self.table.pool_reserved(device, POOL_STAT_FN(on_pool), None) == OK, self.error()
        return out

    def fills(self, member: str) -> bool:
        """Whether pyalloc fills `member` of pyalloc_segment_info, as the bridge asks
        (PYALLOC_SEGMENT_INFO_HAS): the table must have segment_info_size, and it must
        cover the member."""
        field = getattr(Api, "segment_info_size")
        if self.table.size < field.offset + field.size:
            return False
        end = getattr(SegmentInfo, member).offset + getattr(SegmentInfo, member).size
        return self.table.segment_info_size >= end

    def snapshot(self, device: int = -1, pool_id=None, units: bool = False) -> list:
        """snapshot's segments, or (units) snapshot_units'. registration_counter is
        None where pyalloc does not fill it."""
        segments = []
        counted = self.fills("registration_counter")

        def on_segment(_user, seg, blocks, n):
            s = seg.contents
            segments.append({
                "device": s.device, "address": s.address, "total_size": s.total_size,
                "allocated_size": s.allocated_size, "active_size": s.active_size,
                "requested_size": s.requested_size, "stream": s.stream or 0,
                "is_large": bool(s.is_large), "is_expandable": bool(s.is_expandable),
                "pool_id": (s.pool_id[0], s.pool_id[1]),
                "registration_counter": s.registration_counter if counted else None,
                "blocks": [
                    {"size": blocks[i].size, "requested_size": blocks[i].requested_size,
                     "allocated": bool(blocks[i].allocated), "active": bool(blocks[i].active),
                     "context": blocks[i].context}
                    for i in range(n)
                ],
            })

        pool = (u64 * 2)(*pool_id) if pool_id is not None else None
        call = self.table.snapshot_units if units else self.table.snapshot
        status = call(device, pool, SEGMENT_FN(on_segment), None)
        assert status == OK, self.error()
        return segments

    def history(self, device: int = 0) -> list:
        events = []

        def on_entry(_user, e):
            x = e.contents
            events.append({
                "action": ACTIONS[x.action], "addr": x.addr, "size": x.size, "stream": x.stream or 0,
                "time_us": x.time_us, "context": x.context, "pool_id": (x.pool_id[0], x.pool_id[1]),
            })

        assert self.table.history(device, TRACE_FN(on_entry), None) == OK, self.error()
        return events

    def values(self, fn_name: str, *args) -> list:
        out = []
        cb = VALUE_FN(lambda _user, v: out.append(v))
        status = getattr(self.table, fn_name)(*args, cb, None)
        assert status == OK, self.error()
        return out


def checkpoint(api: "BridgeApi", device: int, pool_id) -> list:
    """[(ptr, size, stream)] of the pool's live allocations."""
    out = []

    def on_block(_user, b):
        x = b.contents
        out.append((x.ptr, x.size, x.stream or 0))

    assert api.table.pool_checkpoint(device, *pool_id, LIVE_BLOCK_FN(on_block), None) == OK, api.error()
    return out


def restore(api: "BridgeApi", device: int, pool_id, blocks):
    """(status, freed, allocated) of making exactly `blocks` live in the pool."""
    freed, allocated = [], []
    array = (LiveBlock * max(len(blocks), 1))(*[LiveBlock(p, s, st or None) for p, s, st in blocks])
    status = api.table.pool_restore(device, *pool_id, array, len(blocks),
                                    VALUE_FN(lambda _u, v: freed.append(v)),
                                    VALUE_FN(lambda _u, v: allocated.append(v)), None)
    return status, freed, allocated
