"""The model worker process (`worker="process"`): the same tokens as the in-thread
runner, cancellation that frees blocks, a worker killed with SIGKILL (its step's
requests fail with a clear error, nothing leaks, a new worker serves the next request),
an engine closed mid-step (the worker is stopped and reaped) or while its worker
starts (the worker is killed, not waited for), and the engine's own copy
of the model (it serves until the worker is ready, then releases its weights; it is
loaded again only if no worker can start), and the cores a worker keeps to. Runs on
asyncio and trio."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvscope import Engine
from kvscope.execution.process_runner import MAIN_GUARD_HINT
from kvscope.execution.worker_environment import GOMP_SPINCOUNT, MALLOC_TUNABLES
from kvscope.models.loader import BUNDLED_DIR
from kvscope.scheduling import OPENMP_BINDINGS
from tests.conftest import audit_lines, open_engine, wait_for

pytestmark = pytest.mark.anyio

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
#: Seconds a worker may take to boot on a loaded 2-core machine (python, torch, model).
BOOT = 120


async def worker_ready(engine: Engine) -> int:
    await wait_for(lambda: engine.stats()["worker_pid"] > 0, timeout=BOOT, what="worker ready")
    return engine.stats()["worker_pid"]


def gone(pid: int) -> bool:
    """The process has exited and was reaped (no zombie left behind)."""
    return not Path(f"/proc/{pid}").exists()


async def outputs(engine: Engine) -> list[tuple[int, ...]]:
    greedy = await engine.generate("the same prompt", max_tokens=24, temperature=0)
    seeded = await engine.generate("the same prompt", max_tokens=24, temperature=1.0, seed=11)
    unseeded = await engine.generate("another prompt", max_tokens=24, temperature=0.8)
    # What sampling reads of the request's tokens crosses too (penalties, bad words:
    # a letter the greedy output holds, one byte token of the tiny model's).
    letter = next(chr(t) for t in greedy.token_ids if chr(t).isascii() and chr(t).isalpha())
    processed = await engine.generate(
        "the same prompt",
        max_tokens=24,
        temperature=0,
        presence_penalty=0.5,
        bad_words=[letter],
    )
    assert ord(letter) not in processed.token_ids
    return [greedy.token_ids, seeded.token_ids, unseeded.token_ids, processed.token_ids]


async def test_the_worker_gives_the_same_tokens_as_the_thread():
    async with open_engine(seed=3) as engine:
        expected = await outputs(engine)
    async with open_engine(worker="process", seed=3) as engine:
        pid = await worker_ready(engine)
        assert await outputs(engine) == expected
        assert engine.stats()["worker_pid"] == pid  # every step ran in that worker
    assert gone(pid)


async def test_the_engine_serves_before_the_worker_is_ready():
    async with open_engine(worker="process") as engine:
        # No wait for the worker: steps run in-process until it is ready.
        done = await engine.generate("at once", max_tokens=4, temperature=0)
        assert done.finish_reason == "length"
        await worker_ready(engine)


async def test_cancel_in_the_worker_releases_the_blocks():
    async with open_engine(worker="process") as engine:
        await worker_ready(engine)
        survivor = await engine.submit("survivor", max_tokens=40, ignore_eos=True, temperature=0)
        job = await engine.submit("cancel me", **LONG)
        await wait_for(lambda: len(job.info().token_ids) >= 3)
        report = await engine.cancel(job.id)
        assert report.status == "running" and report.blocks_released >= 1
        assert len(audit_lines(engine, job.id)) == 1
        assert (await survivor.wait()).finish_reason == "length"
        assert engine.stats()["kv_blocks_in_use"] == 0


async def test_a_killed_worker_fails_its_step_and_is_replaced():
    async with open_engine(worker="process") as engine:
        pid = await worker_ready(engine)
        job = await engine.submit("long", **LONG)
        await wait_for(lambda: len(job.info().token_ids) >= 2)
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(BOOT):
            result = await job.wait()
        # Killed mid-step (nearly always): the request fails and says why. Should the
        # kill land between two steps and be noticed first, the step runs in-process.
        if result.finish_reason == "error":
            assert result.error is not None and "model worker" in result.error
            assert f"pid {pid}" in result.error
        else:
            assert result.finish_reason == "length"
        assert engine.stats()["kv_blocks_in_use"] == 0
        assert len(audit_lines(engine, job.id)) == 1
        # A new worker comes up and serves; meanwhile steps wait for it (the engine's
        # own copy of the model released its weights when the first worker was ready).
        after = await engine.generate("after", max_tokens=8, temperature=0)
        assert after.finish_reason == "length"
        new_pid = await worker_ready(engine)
        assert new_pid != pid and engine.stats()["worker_restarts"] == 1
        assert (await engine.generate("again", max_tokens=8)).finish_reason in ("length", "stop")
        assert gone(pid)
    assert gone(new_pid)


async def test_a_step_waiting_for_the_new_worker_ends_when_its_requests_leave():
    """After a worker dies, steps wait for the next one (the engine's copy of the model
    is released); a step whose requests all leave meanwhile ends at once, aborted,
    without waiting for the new worker."""
    async with open_engine(worker="process") as engine:
        pid = await worker_ready(engine)
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: engine.stats()["worker_pid"] != pid, timeout=BOOT)
        job = await engine.submit("waits for the worker", **LONG)
        await wait_for(lambda: job.id in engine.step_statistics().in_flight, what="step formed")
        aborted = engine.step_statistics().aborted_steps
        report = await engine.cancel(job.id)
        assert report.in_running_step and report.blocks_released >= 1
        assert engine.stats()["kv_blocks_in_use"] == 0
        await wait_for(
            lambda: engine.step_statistics().aborted_steps == aborted + 1, what="step aborted"
        )
        # It ended while the new worker was still booting (python, torch, the model).
        assert engine.stats()["worker_pid"] == 0
        assert (await job.wait()).finish_reason == "cancelled"
        new_pid = await worker_ready(engine)
        after = await engine.generate("after", max_tokens=8, temperature=0, ignore_eos=True)
        assert after.finish_reason == "length" and engine.stats()["kv_blocks_in_use"] == 0
        assert engine.step_statistics().aborted_steps == aborted + 1
    assert gone(pid) and gone(new_pid)


#: A prompt of a few full blocks, so that a second request for it finds them cached.
CACHED_PROMPT = "a prompt long enough to fill more than one block of the cache " * 3


async def test_blocks_computed_before_the_worker_was_ready_serve_after_it():
    """The engine's own copy of the model runs the first steps, on the cache it shares;
    the worker takes the cache over with those blocks in it, so a prompt cached then is
    reused after, with the same tokens."""
    async with open_engine(worker="process") as engine:
        before = await engine.generate(CACHED_PROMPT, max_tokens=12, temperature=0)
        assert engine.stats()["worker_pid"] == 0  # it ran in-process (a worker boots in seconds)
        await worker_ready(engine)
        reused = engine.stats()["prompt_tokens_reused"]
        after = await engine.generate(CACHED_PROMPT, max_tokens=12, temperature=0)
        assert engine.stats()["prompt_tokens_reused"] > reused  # its blocks were found
        assert after.token_ids == before.token_ids


async def test_a_dead_workers_cache_is_not_reused():
    """A worker that exits takes the cache's contents with it: the prefix cache forgets
    every block, and the same prompt is computed again, to the same tokens."""
    async with open_engine(worker="process") as engine:
        pid = await worker_ready(engine)
        before = await engine.generate(CACHED_PROMPT, max_tokens=12, temperature=0)
        os.kill(pid, signal.SIGKILL)  # between requests: no step fails
        await wait_for(lambda: engine.stats()["worker_pid"] != pid, timeout=BOOT)
        reused = engine.stats()["prompt_tokens_reused"]
        after = await engine.generate(CACHED_PROMPT, max_tokens=12, temperature=0)
        assert engine.stats()["prompt_tokens_reused"] == reused  # nothing found cached
        assert after.token_ids == before.token_ids
        new_pid = await worker_ready(engine)
    assert gone(pid) and gone(new_pid)


async def test_a_request_the_dead_worker_held_computes_its_tokens_again():
    """A worker that dies between two steps of a request takes its K/V with it: the
    request is not failed (no step of it failed) but computes its tokens again on the
    next worker, and ends as it would have."""
    generation = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with open_engine(seed=3) as engine:
        expected = (await engine.generate("recompute me", **generation)).token_ids
    async with open_engine(worker="process", seed=3) as engine:
        pid = await worker_ready(engine)
        hold, held, release = threading.Event(), threading.Event(), threading.Event()

        def hold_the_next_step() -> None:
            if hold.is_set():
                held.set()
                release.wait(30)

        engine.before_forward.append(hold_the_next_step)  # steps go through the model thread
        job = await engine.submit("recompute me", **generation)
        await wait_for(lambda: len(job.info().token_ids) >= 3)
        hold.set()
        assert await anyio.to_thread.run_sync(held.wait, 10), "no step held"
        preemptions = engine.step_statistics().preemptions
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: engine.stats()["worker_pid"] != pid, timeout=BOOT)
        hold.clear()
        release.set()  # the held step is sent now, after the worker went away
        with anyio.fail_after(BOOT):
            result = await job.wait()
        assert result.finish_reason == "length" and result.token_ids == expected
        assert engine.step_statistics().preemptions == preemptions + 1
        new_pid = await worker_ready(engine)
    assert gone(pid) and gone(new_pid)


async def test_the_engine_releases_its_copy_of_the_model_once_the_worker_is_ready():
    async with open_engine() as engine:
        in_thread = engine.stats()["model_bytes"]
    assert in_thread > 0  # the model runs here, so this copy stays
    async with open_engine(worker="process") as engine:
        await worker_ready(engine)
        assert engine.stats()["model_bytes"] == 0
        assert (await engine.generate("served", max_tokens=8)).finish_reason in ("length", "stop")


async def test_the_model_is_loaded_again_when_no_worker_can_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
):
    """A worker that cannot start (here: its checkpoint is gone when it restarts) leaves
    the steps to the engine, which loads the model again and serves; the worker told
    where its error came from on the stderr it shares with the engine."""
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR, model)
    weights, hidden = model / "model.safetensors", tmp_path / "hidden.safetensors"
    caplog.set_level(logging.WARNING)
    async with open_engine(str(model), worker="process") as engine:
        pid = await worker_ready(engine)
        expected = await engine.generate("the same prompt", max_tokens=12, temperature=0)
        assert engine.stats()["model_bytes"] == 0
        weights.rename(hidden)
        os.kill(pid, signal.SIGKILL)
        await wait_for(
            lambda: any("failed to start" in r.getMessage() for r in caplog.records),
            timeout=BOOT,
            what="the new worker failed",
        )
        hidden.rename(weights)
        again = await engine.generate("the same prompt", max_tokens=12, temperature=0)
        assert again.token_ids == expected.token_ids
        assert engine.stats()["model_bytes"] > 0 and engine.stats()["worker_pid"] == 0
        assert any("loading the model again" in r.getMessage() for r in caplog.records)
    assert gone(pid)
    err = capfd.readouterr().err
    assert "the model worker could not load the model" in err and "Traceback" in err, err


UNGUARDED_SCRIPT = """
import logging
import anyio
from kvscope import Engine

failed = []  # the anyio.Event main() waits on

class Watch(logging.Handler):  # called on the event loop's thread, which logs it
    def emit(self, record):
        if "failed to start" in record.getMessage():
            print("logged:", record.getMessage(), flush=True)
            failed[0].set()

logging.getLogger("kvscope").addHandler(Watch())

async def main():
    failed.append(anyio.Event())
    async with Engine.open("tiny-random", device="cpu", worker="process", model_threads=1) as e:
        with anyio.fail_after(120):
            await failed[0].wait()
        done = await e.generate("hello", max_tokens=4, temperature=0)
        print("finished:", done.finish_reason, "worker:", e.stats()["worker_pid"], flush=True)

anyio.run(main)  # no `if __name__ == "__main__":` guard
"""


async def test_a_script_without_the_main_guard_is_told_why_and_still_served(tmp_path: Path):
    script = tmp_path / "script.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = await anyio.run_process([sys.executable, str(script)], check=False)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, err[-2000:]
    assert (
        f"logged: the model worker failed to start: it exited while loading the model ({MAIN_GUARD_HINT})"
        in out
    ), out
    # The engine serves on in its own process.
    assert "finished: length worker: 0" in out or "finished: stop worker: 0" in out, out


async def test_closing_the_engine_mid_step_stops_the_worker():
    async with open_engine(worker="process") as engine:
        pid = await worker_ready(engine)
        jobs = [await engine.submit(f"long {i}", **LONG) for i in range(3)]
        await wait_for(lambda: all(len(j.info().token_ids) >= 2 for j in jobs))
    # open_engine checked that no block, request or task is left; the worker is reaped.
    assert gone(pid)
    for job in jobs:
        info = job.info()
        assert info.finish_reason == "cancelled" and info.cancel_reason == "shutdown"


async def test_closing_the_engine_while_its_worker_starts_kills_the_worker():
    """A worker still loading or warming up (here: stopped, as if its warm-up took
    minutes) holds nothing yet: closing the engine kills it rather than waiting for it
    to be ready, and the engine, which served on its own copy, closes clean."""
    async with open_engine(worker="process") as engine:
        await wait_for(lambda: _starting_worker() is not None, timeout=BOOT, what="a worker")
        starting = _starting_worker()
        os.kill(starting.pid, signal.SIGSTOP)  # never ready from here on
        answer = await engine.generate("served meanwhile", max_tokens=4, ignore_eos=True)
        assert len(answer.token_ids) == 4 and engine.stats()["worker_pid"] == 0
    assert gone(starting.pid) and starting.exitcode == -signal.SIGKILL


def _starting_worker() -> Any:
    """This process's model worker child, if one is alive."""
    workers = [p for p in multiprocessing.active_children() if p.name == "kvscope-model-worker"]
    return workers[0] if workers else None


HUNG_WORKER_SCRIPT = """
import os, signal, sys, anyio
from kvscope import Engine

async def main():
    async with Engine.open("tiny-random", device="cpu", worker="process", model_threads=1) as e:
        with anyio.fail_after(120):
            while not e.stats()["worker_pid"]:
                await anyio.sleep(0.05)
            pid = e.stats()["worker_pid"]
            print("worker:", pid, flush=True)
            os.kill(pid, signal.SIGSTOP)  # hung: it answers nothing from now on
            job = await e.submit("long", max_tokens=3000, ignore_eos=True, temperature=0)
            while job.id not in e.step_statistics().in_flight:  # its step waits for it
                await anyio.sleep(0.01)
    info = job.info()
    print("closed:", info.finish_reason, "blocks:", e.stats()["kv_blocks_in_use"], flush=True)

if __name__ == "__main__":
    anyio.run(main, backend=sys.argv[1])
"""


async def test_closing_the_engine_with_a_hung_worker_kills_it(tmp_path: Path, anyio_backend):
    """A worker that answers nothing (stopped mid-step) is killed once the stop's
    timeout has passed; the step waiting for it then ends and the engine closes. Run
    in a script of its own, so that a close that never ends fails here instead of
    hanging the tests."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_WORKER_SCRIPT)
    with anyio.fail_after(BOOT):
        done = await anyio.run_process([sys.executable, str(script), anyio_backend], check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    pid = int(out.split("worker:")[1].split()[0])
    assert gone(pid)
    assert "closed: cancelled blocks: 0" in out, out


async def test_structured_output_through_the_worker():
    async with open_engine(worker="process") as engine:
        await worker_ready(engine)
        out = await engine.generate("pick", guided_choice=["alpha", "beta"], max_tokens=10)
        assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
        out = await engine.generate("n", guided_regex="[0-9]{4}", max_tokens=10, temperature=0)
        assert len(out.text) == 4 and out.text.isdigit()
        assert engine.stats()["worker_restarts"] == 0


def thread_nices_and_policies(pid: int) -> set[tuple[int, int]]:
    """The nice value (field 19 of its `stat`) and the scheduling policy of each thread
    of process `pid`."""
    seen = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        seen.add((int(stat.rsplit(")", 1)[1].split()[16]), os.sched_getscheduler(int(task.name))))
    return seen


@pytest.mark.parametrize("nice", [None, 0, 7])
async def test_the_worker_runs_as_a_batch_job_at_its_nice_value(nice: int | None):
    """Every thread of the worker (torch's included) yields the CPU to the event loop by
    `worker_nice` (10 unless given), relative to the engine's own process, and runs as a
    batch job, whose wake-ups never preempt the loop."""
    options = {} if nice is None else {"worker_nice": nice}
    async with open_engine(worker="process", model_threads=2, **options) as engine:
        pid = await worker_ready(engine)
        await engine.generate("spin the threads up", max_tokens=4, temperature=0)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        expected = min(19, base + (10 if nice is None else nice))
        assert thread_nices_and_policies(pid) == {(expected, os.SCHED_BATCH)}


async def test_the_thread_workers_model_threads_run_as_a_batch_job():
    """With the model in a thread, the thread that runs the forward (and the torch
    threads it starts) runs as a batch job; the event loop's thread is left as it was."""
    loop_policy = os.sched_getscheduler(0)
    forward_threads: set[int] = set()
    async with open_engine(worker="thread", model_threads=2) as engine:
        engine.before_forward.append(lambda: forward_threads.add(threading.get_native_id()))
        await engine.generate("spin the threads up", max_tokens=4, temperature=0)
        assert forward_threads
        assert {os.sched_getscheduler(tid) for tid in forward_threads} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == loop_policy


async def test_the_worker_starts_with_its_malloc_tunables_and_openmp_spin(monkeypatch):
    """The worker's environment carries glibc's malloc tunables (huge pages, a heap that
    keeps a step's activations) and OpenMP's longer spin; the engine's own environment
    does not."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    before = os.environ.get("GLIBC_TUNABLES")
    async with open_engine(worker="process") as engine:
        pid = await worker_ready(engine)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"GOMP_SPINCOUNT={GOMP_SPINCOUNT}".encode() in environ
        assert "GOMP_SPINCOUNT" not in os.environ
        tunables = [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
        assert len(tunables) == 1
        # glibc 2.36 cuts the variable after the first tunable it parses (their effect
        # is tested in tests/execution/test_worker_environment.py).
        entries = tunables[0].removeprefix(b"GLIBC_TUNABLES=").decode().split(":")
        ours = [f"{name}={value}" for name, value in MALLOC_TUNABLES.items()]
        assert entries and entries == ours[: len(entries)]
        assert os.environ.get("GLIBC_TUNABLES") == before


def cores_of_each_thread(pid: int) -> set[frozenset[int]]:
    return {
        frozenset(os.sched_getaffinity(int(task.name)))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


@pytest.fixture
def no_openmp_binding(monkeypatch):
    for name in OPENMP_BINDINGS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to leave")
async def test_a_worker_with_fewer_threads_than_cores_keeps_to_the_last(no_openmp_binding, caplog):
    """Its threads (torch's included) keep to the last core, leaving the others to the
    event loop; the engine's own process keeps every core, and the log says which."""
    allowed = os.sched_getaffinity(0)
    caplog.set_level(logging.INFO, logger="kvscope")
    async with open_engine(worker="process", model_threads=1) as engine:
        pid = await worker_ready(engine)
        await engine.generate("spin the threads up", max_tokens=4, temperature=0)
        assert cores_of_each_thread(pid) == {frozenset({max(allowed)})}
        assert os.sched_getaffinity(0) == allowed
    assert f"ready on cores {max(allowed)} in" in caplog.text


async def test_a_worker_whose_threads_fill_the_cores_keeps_every_core(no_openmp_binding):
    allowed = frozenset(os.sched_getaffinity(0))
    async with open_engine(worker="process", model_threads=len(allowed)) as engine:
        pid = await worker_ready(engine)
        await engine.generate("spin the threads up", max_tokens=4, temperature=0)
        assert cores_of_each_thread(pid) == {allowed}


async def test_a_user_who_binds_openmp_keeps_the_cores_the_worker_was_given(monkeypatch):
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    allowed = frozenset(os.sched_getaffinity(0))
    async with open_engine(worker="process", model_threads=1) as engine:
        pid = await worker_ready(engine)
        assert cores_of_each_thread(pid) == {allowed}


async def test_the_worker_keeps_to_the_cores_listed_or_to_all(no_openmp_binding):
    allowed = frozenset(os.sched_getaffinity(0))
    first = min(allowed)
    async with open_engine(worker="process", model_threads=1, worker_cores=str(first)) as engine:
        pid = await worker_ready(engine)
        await engine.generate("spin the threads up", max_tokens=4, temperature=0)
        assert cores_of_each_thread(pid) == {frozenset({first})}
    async with open_engine(worker="process", model_threads=1, worker_cores="all") as engine:
        pid = await worker_ready(engine)
        assert cores_of_each_thread(pid) == {allowed}
