"""The environment a model worker process starts with: glibc's malloc tunables and
libgomp's spin count in its environment (`worker_environment`, around the spawn), and
its nice value on every thread (`nice_every_thread`, in the worker)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvscope.scheduling import threads_of_this_process

#: glibc's malloc tunables the worker starts with, by name.
#:
#: `hugetlb=1`: its large allocations (the weights, their prepacked copies, the activations)
#: ask for transparent huge pages, so a forward's reads miss the TLB less. In-process on the
#: 2-core machine, 2 threads, three alternating runs of 200 steps each: a decode step of 32
#: rows 15.3-15.4 ms (mean) against 15.9-18.8, of one row 7.2-7.7 against 7.6-8.9
#: (docs/benchmarks/README.md, "Measured settings": the worker's heap on huge pages).
#:
#: `mmap_threshold` and `trim_threshold`: a step's activations (up to 32 MiB each) come from
#: the heap, and the heap keeps what the biggest step freed instead of handing it back to
#: the kernel and faulting it in again (zeroing each huge page) the next step: the worker
#: holds its busiest step's memory, as a caching allocator would. A step of 8 prompts of 256
#: tokens and 8 decode rows, in-process, 2 threads, 20 steps a run: 0.2-0.4 page faults a
#: step against 31-62, a mean of 95-111 ms in five runs against 114-127 with `hugetlb`
#: alone, in four (docs/benchmarks/README.md, "Measured settings": the worker's heap keeps
#: its pages). Served, the worker had settled to few faults after its first level anyway (81
#: in a level, against 0-6), and 32 streams showed no difference in three alternating pairs;
#: the tunables take the first level's 1,400 faults and the in-process variance away.
#:
#: A glibc before 2.35 ignores `hugetlb`; a kernel with transparent huge pages off
#: ignores the advice.
MALLOC_TUNABLES = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_threshold": str(32 << 20),  # glibc's largest
    "glibc.malloc.trim_threshold": str(1 << 30),
}


#: How long (in spins of libgomp, torch's OpenMP runtime) a model thread that waits, at
#: a barrier or for the next step, spins before it sleeps; set in the worker's
#: environment unless the user set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`. libgomp's
#: default, 300,000, is ~4 ms here, less than a served worker's wait between one
#: request's last step and the next one's first (~5 ms at one stream) or between
#: steps while the loop takes in a burst of requests; the helper then sleeps, and the
#: next forward waits for it to wake. 3,000,000 is ~40 ms, spent once each time the
#: worker goes idle (measured: 40 ms of CPU in the idle second after a parallel op,
#: against 10). Served on the 2-core machine, 2 threads, beside the real-time loop,
#: alternating: 32 streams, four pairs of two levels, 1,358-1,531 tok/s against
#: 1,113-1,527, TTFT p50 201-258 ms against 209-284; one stream, four pairs, TTFT p50
#: 26.2-27.4 ms against 27.3-36.2, 151-162 tok/s against 152-166 (docs/benchmarks/
#: README.md, "Measured settings": OpenMP threads spin longer). Intel's OpenMP runtime,
#: where torch uses it, ignores it (its own `KMP_BLOCKTIME` is 200 ms).
GOMP_SPINCOUNT = 3_000_000


@contextmanager
def worker_environment() -> Iterator[None]:
    """The environment a worker process is spawned with: this process's, plus
    `worker_variables`. multiprocessing's spawn takes no environment of its own, so this
    process's is changed for the spawn's duration and restored after it; another thread
    that reads those variables meanwhile sees the worker's values (glibc and OpenMP
    read them only at a program's start, so no running code changes behaviour)."""
    changes = worker_variables(os.environ)
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def worker_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a worker's environment sets beyond `environ`: `GLIBC_TUNABLES` with
    each of `MALLOC_TUNABLES` the user's does not set already (theirs wins), and
    `GOMP_SPINCOUNT` unless the user set it or `OMP_WAIT_POLICY`."""
    users = [entry for entry in environ.get("GLIBC_TUNABLES", "").split(":") if entry]
    named = {entry.split("=", 1)[0] for entry in users}
    ours = [f"{name}={value}" for name, value in MALLOC_TUNABLES.items() if name not in named]
    variables = {"GLIBC_TUNABLES": ":".join(users + ours)}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        variables["GOMP_SPINCOUNT"] = str(GOMP_SPINCOUNT)
    return variables


def nice_every_thread(increment: int) -> None:
    """Lower this process's priority by `increment`: Linux keeps a nice value per thread,
    so the threads already running (one starts before `worker_main`) are set one by one;
    the ones started later inherit it from their creator."""
    value = os.nice(increment)
    for thread in threads_of_this_process():
        try:
            os.setpriority(os.PRIO_PROCESS, thread, value)
        except ProcessLookupError:
            pass  # it ended since the listing
