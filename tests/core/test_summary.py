"""memory_summary()'s text, from the stats of a host-backend Allocator."""
from __future__ import annotations

import pytest

import pyalloc
from pyalloc._summary import WIDTH, format_summary, size_text

MiB = 1 << 20


@pytest.fixture
def pool():
    a = pyalloc.Allocator("host")
    ptrs = [a.malloc(n) for n in (1000, 3 * MiB, 700, 50 * MiB, MiB)]
    a.free(ptrs[1])
    a.free(ptrs[2])
    return a


def row_cells(line: str):
    return [c.strip() for c in line.strip("|").split("|")[1:]]


def cells(text: str, label: str):
    return row_cells(next(l for l in text.splitlines() if l.startswith(f"| {label} ")))


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (20 * MiB, "20.0 MiB"),
     (3 << 30, "3.0 GiB"), (5 << 40, "5.0 TiB")],
)
def test_size_text(n, text):
    assert size_text(n) == text


def test_table_of_every_metric(pool):
    stats, frag = pool.stats(), pool.fragmentation()
    text = format_summary(stats, frag, device=3)
    assert all(len(line) == WIDTH for line in text.splitlines())
    assert "pyalloc CUDA memory summary, device 3" in text
    assert cells(text, "Metric") == ["Current", "Peak", "Tot alloc", "Tot freed"]
    assert cells(text, "Allocated memory") == [
        size_text(stats[f"allocated_bytes.all.{k}"]) for k in ("current", "peak", "allocated", "freed")
    ]
    assert cells(text, "Reserved segments") == [
        f"{stats[f'segment.all.{k}']:,}" for k in ("current", "peak", "allocated", "freed")
    ]
    for label in ("Active memory", "Requested memory", "Reserved memory", "Non-releasable memory",
                  "Allocations", "Active allocs", "Non-releasable allocs", "Oversize allocations",
                  "Oversize segments"):
        assert cells(text, label)
    assert text.count("from large pool") == 9 and text.count("from small pool") == 9


def test_fragmentation_section(pool):
    stats, frag = pool.stats(), pool.fragmentation()
    text = format_summary(stats, frag)
    assert f"Free in reserved memory:  {size_text(frag['free_bytes'])} in {frag['free_blocks']} blocks" in text
    assert f"Largest free block:       {size_text(frag['largest_free_block'])}" in text
    assert f"External fragmentation:   {100 * frag['external_fragmentation']:.1f} %" in text
    assert "Max split size:           unlimited" in text
    histogram = text.split("Free blocks by size")[1].splitlines()[1:-1]
    assert [row_cells(line) for line in histogram] == [
        [f"{h['count']:,}", size_text(h["bytes"])] for h in frag["histogram"]
    ]
    assert "Held for CUDA graphs" not in text


def test_abbreviated_and_extras(pool):
    stats, frag = pool.stats(), pool.fragmentation()
    short = format_summary(stats, frag, abbreviated=True, graph_blocks=2, graph_bytes=3 * MiB)
    assert "from large pool" not in short and "Free blocks by size" not in short
    assert "Held for CUDA graphs:      3.0 MiB in 2 blocks" in short
    capped = pyalloc.Allocator("host", max_split_size="64MiB")
    assert "Max split size:           64.0 MiB" in format_summary(capped.stats(), capped.fragmentation())


def test_counts_large_numbers_readably():
    stats = pyalloc.Allocator("virtual").stats()
    stats["allocation.all.allocated"] = 12_345_678
    text = format_summary(stats, pyalloc.Allocator("virtual").fragmentation())
    assert cells(text, "Allocations")[2] == "12,345,678"



@pytest.fixture
def distinct():
    """A pool whose figures differ from family to family: a pending free (active
    above allocated), requests below their blocks' sizes, split segments."""
    a = pyalloc.Allocator("virtual", strategy="bestfit", segment_size=20 * MiB)
    keep = [a.malloc(n) for n in (1000, 700, 5 * MiB, 3 * MiB + 100)]
    a.free(a.malloc(2 * MiB))
    a.free(keep[0])  # free blocks on both sides of the 700 B one
    pending = a.malloc(6 * MiB + 1, stream=1)
    a.record_stream(pending, 2)
    a.stream_set_busy(2)
    a.free(pending)
    return a


def rows(text: str, label: str):
    """The cells of a metric's row and of its large- and small-pool rows below it."""
    lines = text.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith(f"| {label} "))
    return [row_cells(lines[at + k]) for k in range(3)]


@pytest.mark.parametrize("family, label, show", [
    ("allocated_bytes", "Allocated memory", size_text),
    ("active_bytes", "Active memory", size_text),
    ("requested_bytes", "Requested memory", size_text),
    ("reserved_bytes", "Reserved memory", size_text),
    ("inactive_split_bytes", "Non-releasable memory", size_text),
    ("allocation", "Allocations", lambda n: f"{n:,}"),
    ("active", "Active allocs", lambda n: f"{n:,}"),
    ("segment", "Reserved segments", lambda n: f"{n:,}"),
    ("inactive_split", "Non-releasable allocs", lambda n: f"{n:,}"),
])
def test_each_row_shows_its_own_family_by_value(distinct, family, label, show):
    # torch.cuda.memory_summary()'s rows, each from the memory_stats() keys it
    # names; the fixture tells every family apart, so a row showing another
    # family's figures (or a count for bytes) fails.
    stats = distinct.stats()
    others = [f for f in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                          "inactive_split_bytes", "allocation", "active", "segment", "inactive_split")
              if f != family]
    columns = ("current", "peak", "allocated", "freed")
    mine = [stats[f"{family}.all.{k}"] for k in columns]
    assert all(mine != [stats[f"{o}.all.{k}"] for k in columns] for o in others), family
    text = format_summary(stats, distinct.fragmentation())
    assert rows(text, label) == [
        [show(stats[f"{family}.{pool_name}.{k}"]) for k in columns]
        for pool_name in ("all", "large_pool", "small_pool")
    ]


def test_the_counters_line_shows_each_counter_by_value():
    a = pyalloc.Allocator("virtual", capacity=64 * MiB, strategy="bestfit", segment_size=20 * MiB)
    ps = [a.malloc(6 * MiB) for _ in range(8)]
    for p in ps[::2]:
        a.free(p)
    with pytest.raises(pyalloc.OutOfMemoryError):
        a.malloc(20 * MiB)  # one error, after one retry
    with pytest.raises(pyalloc.OutOfMemoryError):
        a.malloc(1 << 40)  # one more, refused at once
    for p in ps[1::2]:
        a.free(p)
    a.empty_cache()  # three segments back
    a.malloc(2 * MiB)  # a fourth
    stats = a.stats()
    figures = [stats[k] for k in ("num_ooms", "num_alloc_retries", "num_device_alloc", "num_device_free")]
    assert len(set(figures)) == 4, figures
    text = format_summary(stats, a.fragmentation())
    assert (f"Out-of-memory errors: {stats['num_ooms']:,}    "
            f"retries after emptying the cache: {stats['num_alloc_retries']:,}") in text
    assert (f"Segments reserved from the device: {stats['num_device_alloc']:,}    "
            f"released: {stats['num_device_free']:,}") in text
