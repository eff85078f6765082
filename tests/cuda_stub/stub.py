"""The stand-in driver's `stub` struct (libcuda_stub.c) in ctypes, field for field."""
import ctypes as c


class Stub(c.Structure):
    _fields_ = [
        ("capacity", c.c_int64), ("used", c.c_int64 * 2), ("fail_alloc_size", c.c_int64),
        ("events_pending", c.c_int), ("capturing_stream", c.c_uint64), ("capture_id", c.c_uint64),
        ("mem_alloc", c.c_int64), ("mem_free", c.c_int64), ("event_create", c.c_int64),
        ("event_record", c.c_int64), ("event_query", c.c_int64), ("event_sync", c.c_int64),
        ("event_destroy", c.c_int64), ("capture_queries", c.c_int64),
        ("forbidden_during_capture", c.c_int64), ("wrong_context", c.c_int64),
        ("vmm", c.c_int), ("mem_create", c.c_int64), ("mem_release", c.c_int64),
        ("mem_map", c.c_int64), ("mem_unmap", c.c_int64), ("mapped", c.c_int64 * 2),
        ("event_error", c.c_int), ("sync_error", c.c_int), ("peer_access", c.c_int),
        ("refuse_peers", c.c_int), ("vmm_refuse", c.c_int),
        ("ctx_set", c.c_int64), ("event_record_errors", c.c_int64), ("stream_get_ctx", c.c_int64),
        ("capture_info_v1", c.c_int64), ("access_count", c.c_int64), ("access_mask", c.c_int64),
        ("destroyed_stream", c.c_uint64), ("destroyed_queries", c.c_int64),
        ("mode_exchanges", c.c_int64), ("relaxed_during_capture", c.c_int64),
        ("mem_get_info", c.c_int64), ("mem_alloc_refused", c.c_int64), ("mem_create_refused", c.c_int64),
        ("mem_set_access", c.c_int64), ("mem_address_reserve", c.c_int64), ("set_access_oom", c.c_int),
        ("bad_handle", c.c_int64), ("fail_remap", c.c_int),
        ("pause_mem_free", c.c_int), ("paused", c.c_int), ("pause_mem_get_info", c.c_int),
        ("fail_create_size", c.c_int64), ("map_oom", c.c_int), ("mem_map_refused", c.c_int64),
        ("set_access_fail", c.c_int), ("mem_failed", c.c_int64),
        ("ipc_get", c.c_int64), ("ipc_open", c.c_int64), ("ipc_close", c.c_int64), ("ipc_opened", c.c_int64),
        ("exports", c.c_int64), ("imports", c.c_int64), ("imported", c.c_int64),
        ("refuse_fd_handles", c.c_int), ("fd_handles", c.c_int64), ("fail_ctx_set_in", c.c_int),
        ("refuse_fd_handles_with", c.c_int), ("capture_invalidated", c.c_int64),
        ("vmm_refused", c.c_int64), ("ctx_synchronize", c.c_int64), ("work_queued", c.c_int),
        ("unmapped_under_work", c.c_int64), ("mem_address_free", c.c_int64),
        ("pause_ctx_synchronize", c.c_int),
    ]
