"""Allocation from several threads at once, each on its own stream, with frees across threads."""
import queue
import random
import threading

import torch

import pyalloc

THREADS, ROUNDS = 8, 300


def worker(tid, handoff, errors):
    try:
        rng = random.Random(tid)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for i in range(ROUNDS):
                n = rng.choice([1, 100, 4096, 70_000, 300_000, 3_000_000])
                t = torch.full((n,), tid, dtype=torch.int32, device="cuda")
                if int(t.sum()) != tid * n:  # integer sums: exact
                    raise AssertionError(f"thread {tid}: corrupted block at round {i}")
                if i % 7 == 0:
                    stream.synchronize()
                    handoff.put(t)  # another thread frees it
                try:
                    other = handoff.get_nowait()
                    del other
                except queue.Empty:
                    pass
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)


def main():
    pyalloc.install()
    torch.cuda.init()
    base = pyalloc.memory_allocated()
    handoff, errors = queue.Queue(), []
    threads = [threading.Thread(target=worker, args=(t, handoff, errors)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    while not handoff.empty():
        handoff.get()
    torch.cuda.synchronize()
    assert pyalloc.memory_allocated() == base, (pyalloc.memory_allocated(), base)
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
