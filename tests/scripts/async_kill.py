"""SIGKILLs in the middle of background checkpoint writes, each followed by a restart
(tests/test_async_checkpoint_crash.py).

    python async_kill.py OUT SEED KILLS

One process that imports torch once and forks every run (so 20 kills cost one import): a
reference run, a calibration run, KILLS runs that are each killed, and a last run that trains to
the end. A run is one process (world of 1), the checkpointing tests' DropMLP with dropout,
AdamW, a warm-up schedule and a loader that crosses epochs, with
``"checkpoint": {"save_dir", "save_interval_steps": 1, "auto_resume": true, "async": true}``:
every step's end stages the state and a thread writes it while the next step trains.

The moments: each filesystem call of the writer thread (every tensor written, every fsync,
rename and replace, the start of the write) is an event. The calibration run counts the events
of one save, E. Kill i draws (from SEED) the save of its run to die in (the 1st to 3rd; the
2nd or 3rd for the very first run, so that a complete checkpoint exists) and an event in
[0, E); before that event happens, the writer thread records OUT/kills.jsonl (the save's
step, the event, whether ``latest`` already names that save, hence the step a restart must
resume from) and SIGKILLs the process.

Every run after the first resumes (``auto_resume``) from other initial weights and random
streams (seed 99), so a resume that restores anything short of everything fails; it records
in OUT/resumes.jsonl the step it resumed from and the names of the parameters that differ
from the reference run's at that step. The last run also records the final comparison.
OUT/exits.jsonl: how each run ended.
"""

import json
import os
import random
import signal
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared models

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401 - the first optimizer imports it (~10 s): once, here
from checkpointing import config, engine_for  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from shardwise.checkpoint import async_save, safetensors_file  # noqa: E402

STEPS, DROPOUT = 64, 0.1  # 20 kills advance at most 3 steps each
WRITER = "shardwise-checkpoint-writer"


def _log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class Events:
    """Counts the writer thread's filesystem calls; kills the process at a chosen one."""

    def __init__(self, out: Path, save: int | None = None, event: int | None = None) -> None:
        self.out, self.kill_save, self.kill_event = out, save, event
        self.saves, self.count, self.per_save = 0, 0, []
        self.step, self.last_complete, self.latest_moved = None, 0, False

    def install(self) -> None:
        def counted(fn, what):
            def call(*args, **kwargs):
                if threading.current_thread().name == WRITER:
                    self.tick(what, args)
                return fn(*args, **kwargs)

            return call

        safetensors_file._bytes_view = counted(safetensors_file._bytes_view, "tensor")
        for name in ("fsync", "rename", "replace"):
            setattr(os, name, counted(getattr(os, name), name))
        finish = async_save.finish_save

        def finish_save(plan, *args, **kwargs):
            self.saves, self.step, self.latest_moved = self.saves + 1, plan.step, False
            self.per_save.append(0)
            self.tick("start", ())
            path = finish(plan, *args, **kwargs)
            self.last_complete = plan.step
            return path

        async_save.finish_save = finish_save

    def tick(self, what: str, args: tuple) -> None:
        self.per_save[-1] += 1
        if self.kill_save is not None and self.saves >= self.kill_save:
            if self.count == self.kill_event:
                expect = self.step if self.latest_moved else self.last_complete
                record = {"step": self.step, "event": self.count, "what": what, "expect": expect}
                _log(self.out / "kills.jsonl", record)
                os.kill(os.getpid(), signal.SIGKILL)
            self.count += 1
        if what == "replace" and str(args[1]).endswith("/latest"):
            self.latest_moved = True  # the save is the newest complete one from here on


def block(out: Path, save_dir: str = "ckpts") -> dict:
    ckpt = {"save_dir": str(out / save_dir), "save_interval_steps": 1}
    return config(checkpoint={**ckpt, "auto_resume": True, "async": True})


def reference(out: Path) -> None:
    """The uninterrupted run: its parameters after every step (key ``<step>/<name>``)."""
    engine = engine_for(config(), DROPOUT, seed=0)
    params = {f"0/{n}": p for n, p in _params(engine).items()}
    for _ in range(STEPS):
        engine.train_batch()
        params |= {f"{engine.global_steps}/{n}": p for n, p in _params(engine).items()}
    save_file(params, str(out / "reference.safetensors"))


def calibrate(out: Path) -> None:
    events = Events(out)
    events.install()
    engine = engine_for(block(out, "calibration"), DROPOUT, seed=0)
    for _ in range(3):
        engine.train_batch()
    engine.wait_for_checkpoint()
    (out / "events_per_save").write_text(str(max(events.per_save)))


def run(out: Path, i: int, spec: tuple[int, int] | None) -> None:
    """Run ``i``: resume, compare with the reference, train until killed (``spec``: the save
    and event to die at) or to the end (``spec`` None)."""
    events = Events(out, *(spec or (None, None)))
    events.install()
    engine = engine_for(block(out), DROPOUT, seed=0 if i == 0 else 99)
    resumed = engine.global_steps
    events.last_complete = resumed
    ref = load_file(str(out / "reference.safetensors"))
    differ = [n for n, p in _params(engine).items() if not torch.equal(p, ref[f"{resumed}/{n}"])]
    _log(out / "resumes.jsonl", {"run": i, "step": resumed, "differ": differ})
    for _ in range(resumed, STEPS):
        engine.train_batch()
    engine.wait_for_checkpoint()
    final = [n for n, p in _params(engine).items() if not torch.equal(p, ref[f"{STEPS}/{n}"])]
    _log(out / "resumes.jsonl", {"run": i, "final": engine.global_steps, "differ": final})
    engine.destroy()


def forked(fn, *args) -> str:
    """``fn(*args)`` in a child process; how it ended."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.set_num_threads(1)
            fn(*args)
        except BaseException:  # noqa: BLE001 - reported through the exit log
            _log(args[0] / "errors.txt", {"fn": fn.__name__, "error": traceback.format_exc()})
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    out, seed, kills = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    for fn in (reference, calibrate):
        _log(out / "exits.jsonl", {"run": fn.__name__, "end": forked(fn, out)})
    per_save = int((out / "events_per_save").read_text())
    rng = random.Random(seed)
    specs = [(rng.randint(2 if i == 0 else 1, 3), rng.randrange(per_save)) for i in range(kills)]
    for i, spec in enumerate([*specs, None]):
        _log(out / "exits.jsonl", {"run": i, "spec": spec, "end": forked(run, out, i, spec)})


if __name__ == "__main__":
    main()
