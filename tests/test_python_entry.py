"""The Python entry (mixprec.train / mixprec.sweep), driven as a notebook drives it: objects in,
the same run dir and summary out, the same refusals as exceptions naming the key."""

from __future__ import annotations

import json

import pytest
import torch

import mixprec
from mixprec.core.errors import ConfigError

from conftest import ROOT

CPU = ["hardware=cpu", "logger=none", "trainer.max_steps=6", "trainer.perf_warmup_steps=0"]


@pytest.fixture
def user(monkeypatch):
    """The user's own modules (tests/plugins), imported as a notebook imports them."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    import own_data
    import own_models

    return own_models, own_data


def test_a_module_and_two_datasets_train_and_the_module_is_left_as_it_was(user, tmp_path):
    own_models, own_data = user
    net = own_models.plain_mlp(num_classes=4, input_shape=(1, 8, 8))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    d = own_data.blobs()
    s = mixprec.train(
        model=net,
        data=(d["train"], d["val"]),
        num_classes=4,
        overrides=[*CPU, "precision=bf16"],
        run_dir=tmp_path / "run",
    )
    assert (s["status"], s["steps"], s["precision"]) == ("completed", 6, "bf16")
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["val_loss"] == s["val_loss"]
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert "completed in" in (tmp_path / "run" / "train.log").read_text()
    trained = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert any(not torch.equal(trained[k], before[k]) for k in before)  # it trained a copy
    assert all(torch.equal(net.state_dict()[k], before[k]) for k in before)  # not the user's


def test_a_builder_gets_the_runs_facts_and_a_sweep_writes_its_report(user, tmp_path):
    own_models, own_data = user
    runs = mixprec.sweep(
        model=own_models.plain_mlp,  # called with num_classes and input_shape from the data
        data=own_data.blobs(),
        precisions=["fp32", "bf16"],
        overrides=CPU,
        sweep_dir=tmp_path / "sweep",
    )
    assert {p: s["status"] for p, s in runs.items()} == {"fp32": "completed", "bf16": "completed"}
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "| fp32 |" in report and "| bf16 |" in report


def test_an_objects_key_that_reads_as_a_number_still_reaches_the_run(user, tmp_path, monkeypatch):
    """The key that carries your objects is a Hydra override value: a uuid whose hex prefix is
    digits around one 'e' (9e99999999..) was parsed as the float inf and refused (CI, round 6)."""
    import uuid

    own_models, own_data = user
    n = iter(range(10))  # the model's and the data's keys: each 9e99999999N...
    fake = lambda: uuid.UUID(f"9e999999999{next(n)}40008000000000000000")  # noqa: E731
    monkeypatch.setattr(uuid, "uuid4", fake)
    s = mixprec.train(
        model=own_models.plain_mlp, data=own_data.blobs(), overrides=CPU, run_dir=tmp_path / "r"
    )
    assert s["status"] == "completed"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(overrides=["precision=fp64"]), "Could not find 'precision/fp64'"),
        (dict(overrides=["trainer.max_steps=0"]), "trainer.max_steps=0"),
        (dict(data=("train", "val")), "one of num_classes= .* or vocab_size="),
        (dict(model=42), "got int: give a torch.nn.Module"),
    ],
)
def test_bad_inputs_raise_a_config_error_naming_them_and_write_nothing(tmp_path, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        mixprec.train(**{"overrides": CPU, **kwargs}, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_docs_python_block_runs_as_written(user, tmp_path, monkeypatch):
    """docs/own-model.md's `mixprec.train` block, pasted into a notebook cell."""
    import re

    text = (ROOT / "docs" / "own-model.md").read_text()
    block = re.search(r"## From Python.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    cell: dict = {}
    exec(compile(block, "own-model.md", "exec"), cell)
    assert cell["summary"]["status"] == "completed"
    assert {p: s["status"] for p, s in cell["runs"].items()} == {
        "fp32": "completed",
        "bf16": "completed",
    }
    assert (tmp_path / "outputs" / "python" / "mlp" / "summary.json").is_file()


class Tuple3(torch.nn.Module):
    """A model whose forward returns three tensors: no logits the data can read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 4)

    def forward(self, x):
        y = self.lin(x.flatten(1))
        return y, y, y


def per_sample(logits, targets):
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize(
    "given, needle",
    [
        (dict(model=Tuple3()), r"mixprec.train\(model=Tuple3\) returns tuple"),
        (dict(loss=per_sample), r"mixprec.train\(loss=per_sample\) returned torch.float32"),
    ],
)
def test_your_objects_refused_at_the_first_step_are_named_and_leave_no_run_dir(
    user, tmp_path, caplog, given, needle
):
    """A model or loss refused when first called (at the run's first step, after the build)
    raises a ConfigError naming your class or function, not the placeholders that carry
    them (mixprec.api:model_object, loss_<key>), in the log too; the run dir it had made is
    removed, and the next, fixed call into the same dir trains."""
    own_models, own_data = user
    data = own_data.blobs(size=8)
    kw = {"model": own_models.plain_mlp(num_classes=4, input_shape=(1, 8, 8)), **given}
    with pytest.raises(ConfigError, match=needle) as e:
        mixprec.train(
            data=(data["train"], data["val"]),
            num_classes=4,
            overrides=CPU,
            run_dir=tmp_path / "run",
            **kw,
        )
    assert "mixprec.api" not in str(e.value) and "mixprec.api" not in caplog.text
    assert not (tmp_path / "run").exists()
    fixed = {k: v for k, v in kw.items() if k == "model" and not isinstance(v, Tuple3)}
    fixed.setdefault("model", own_models.plain_mlp(num_classes=4, input_shape=(1, 8, 8)))
    done = mixprec.train(
        data=(data["train"], data["val"]), overrides=CPU, run_dir=tmp_path / "run", **fixed
    )
    assert done["status"] == "completed" and not (tmp_path / "run" / ".lock").exists()
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_num_classes_is_inferred_from_the_models_output_or_the_labels(user, tmp_path, caplog):
    """(train, val) without num_classes=: a module's output for the first sample says 4; a
    callable model says
    nothing, so the datasets' integer labels do (1 + the largest: 4); both said in the log.
    Float labels show nothing: the refusal stays."""
    caplog.set_level("INFO")
    own_models, own_data = user
    data = own_data.blobs(size=8)
    pair = (data["train"], data["val"])
    net = own_models.plain_mlp(num_classes=4, input_shape=(1, 8, 8))
    first = mixprec.train(model=net, data=pair, overrides=CPU, run_dir=tmp_path / "a")
    assert (
        first["status"] == "completed"
        and "num_classes=4: the width of the model's output for the first sample" in caplog.text
    )
    second = mixprec.train(
        model=own_models.plain_mlp, data=pair, overrides=CPU, run_dir=tmp_path / "b"
    )
    assert (
        second["status"] == "completed"
        and "num_classes=4: 1 + the largest integer label" in caplog.text
    )
    floats = torch.utils.data.TensorDataset(torch.randn(8, 1, 8, 8), torch.rand(8))
    with pytest.raises(ConfigError, match="neither the model's output nor integer labels"):
        mixprec.train(
            model=own_models.plain_mlp, data=(floats, floats), overrides=CPU, run_dir=tmp_path / "c"
        )
    assert not (tmp_path / "c").exists()


class HeadFirst(torch.nn.Module):
    """A model whose last registered Linear is not its classifier (an auxiliary projection
    registered after the head): its output has 4 classes, its last Linear 16 features."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, classes))
        self.aux = torch.nn.Linear(classes, 16)

    def forward(self, x):
        return self.head(x)


class Raising(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise OSError("sample 5 is on a disk that went away")
        return torch.randn(1, 8, 8), i % 4


def labelled(labels: list[int]) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(len(labels), 1, 8, 8), torch.tensor(labels))


@pytest.mark.parametrize(
    "model,data,said",
    [
        (
            lambda: HeadFirst(4),
            lambda: (labelled([0, 1, 2, 9]),) * 2,
            "a label is 9: labels are 0..3",
        ),
        (lambda: HeadFirst(4), lambda: (labelled([0, -1, 2, 3]),) * 2, "a label is -1"),
        (lambda: HeadFirst(1), lambda: (labelled([0, 1, 0, 1]),) * 2, "a one-output head"),
        (lambda: HeadFirst(4), lambda: (Raising(), Raising()), "raised OSError: sample 5"),
    ],
    ids=["label-above-outputs", "negative-label", "one-logit", "dataset-raises"],
)
def test_classes_that_do_not_fit_the_labels_are_one_config_error_before_training(
    tmp_path, model, data, said
):
    """Issue 90, item 10: the classes come from the model's output (HeadFirst's last Linear
    has 16 features, its head 4: 16 was taken); labels that do not fit, a one-logit head or a
    dataset raising while its labels are read were torch IndexErrors or RuntimeErrors with a
    failed run dir. One ConfigError naming what does not fit, before anything is written."""
    with pytest.raises(ConfigError, match=said):
        mixprec.train(model=model(), data=data(), overrides=CPU, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_head_registered_before_another_linear_gives_the_classes(tmp_path, caplog):
    caplog.set_level("INFO")
    done = mixprec.train(
        model=HeadFirst(4),
        data=(labelled([0, 1, 2, 3] * 32),) * 2,
        overrides=CPU,
        run_dir=tmp_path / "run",
    )
    assert done["status"] == "completed" and "num_classes=4: the width" in caplog.text
