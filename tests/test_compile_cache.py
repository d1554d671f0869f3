"""model.compile_cache: torch.compiler's cache artifacts (compiled graphs, kernels, tuning
results) written by a completed compiled run and loaded by the next, on a machine whose own
inductor cache is empty (a new machine, as in CI). Each run is a process of its own, as users
run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_train

# the smallest compiled model: the two runs' CPU compiles (C++) took 42 CPU-s (the LM's block:
# 63, test_lm.py compiles it; the whole 4-layer LM: 78 s)
COMPILED = ["model=digits_mlp", "trainer.max_steps=3", "model.compile=true", "logger=none"]


def train(tmp_path: Path, name: str, cache: Path, inductor: str) -> tuple[str, dict]:
    run_dir = tmp_path / name
    proc = run_train(
        [*COMPILED, f"model.compile_cache={cache}", f"hydra.run.dir={run_dir}"],
        env_extra={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    return log, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_a_compiled_run_writes_its_kernels_and_the_next_run_on_a_new_machine_loads_them(
    tmp_path,
):
    cache = tmp_path / "kernels" / "fast.bin"
    log, first = train(tmp_path, "a", cache, "inductor_a")  # compiled and trained
    assert first["status"] == "completed" and first["compile_s"] > 0
    assert "does not exist yet; this run will write it" in log
    assert cache.is_file() and cache.stat().st_size > 1000
    written = cache.read_bytes()
    # a new machine: inductor's own cache empty; the file brings the compiled graphs
    log, second = train(tmp_path, "b", cache, "inductor_b")
    loaded = next(line for line in log.splitlines() if "model.compile_cache: loaded" in line)
    assert "'inductor': " in loaded and "'aot_autograd': " in loaded, loaded
    assert any((tmp_path / "inductor_b").rglob("*")), "the artifacts were not put in its cache"
    assert cache.read_bytes() == written  # the file it loaded is kept as it was
    assert second["train_loss"] == first["train_loss"]  # the same compiled code, the same run


def test_a_file_that_holds_no_artifacts_is_a_warning_and_nothing_is_loaded(tmp_path, caplog):
    from mixprec.compile import compiling

    bad = tmp_path / "fast.bin"
    bad.write_bytes(b"not artifacts")
    with caplog.at_level("INFO", logger="mixprec.models"):
        compiling.load_cache(str(bad))
        compiling.load_cache(str(tmp_path / "none.bin"))
        compiling.save_cache(str(bad))  # nothing compiled here, and the file exists: kept
    assert "did not load" in caplog.text and "does not exist yet" in caplog.text
    assert bad.read_bytes() == b"not artifacts"
