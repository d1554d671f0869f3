"""Your training as it is (issue 69): a loss of your own by import path, token classification,
a dataset's own collator (transformers' DataCollatorForTokenClassification: ragged samples
padded per batch, labels padded with -100), dict inputs passed to the model by keyword, and a
Hugging Face causal LM trained on the loss it computes itself. Each trains end to end on the
CPU; padding is left out of the loss and the metrics; a resume through the collator and the
loader's workers is bit-exact; a mistake is a config error naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.core import tasks
from mixprec.core.errors import ConfigError
from mixprec.precision.base import GradScaler, Precision, PrecisionConfig
from mixprec.run import session as run
from mixprec.run.config import validate
from mixprec.training import loop

from conftest import ROOT, TINY_BERT, compose_cfg, last_weights, run_torchrun, train_losses

PLUGINS = ROOT / "tests" / "plugins"
SMALL = ["hardware=cpu", "logger=none", "trainer.log_every=1", "trainer.perf_warmup_steps=0"]
USER = [f"model.path={PLUGINS}", f"data.path={PLUGINS}", "data=custom"]
CONV = [*USER, "model.target=own_models:TinyConvNet", "data.target=own_data:blobs"]
LM = [
    *USER,
    "model.target=own_models:TinyLM",
    "data.target=own_data:counting",
    "optimizer.lr=0.003",
]
TAGS = [*USER, "model.target=own_models:TinyTagger", "data.target=own_data:tagged"]
TAGS += ["data.input_key=**", "batch=32", "optimizer.lr=0.01"]


def cfg(tmp_path: Path, *overrides: str, name: str = "run"):
    return compose_cfg([*SMALL, *overrides], tmp_path / name)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_loss_by_import_path_is_the_one_trained_on(tmp_path):
    """model.loss=own_losses:plus_ten (the cross-entropy + 10): every logged loss is the task's
    + 10, the weights are the task loss's (the constant has no gradient), amp's GradScaler
    scaled it, and val/loss is the user's loss too."""
    base = [*CONV, "precision=amp", "batch=16", "trainer.max_steps=4"]
    mine = run.run(cfg(tmp_path, *base, "model.loss=own_losses:plus_ten", name="mine"))
    task = run.run(cfg(tmp_path, *base, name="task"))
    a, b = train_losses(tmp_path / "mine"), train_losses(tmp_path / "task")
    assert len(a) == 4 and all(abs(x - y - 10.0) < 1e-3 for x, y in zip(a, b)), (a, b)
    assert abs(mine["val_loss"] - task["val_loss"] - 10.0) < 1e-3
    assert mine["loss_scale"] > 1
    wa, wb = last_weights(tmp_path / "mine"), last_weights(tmp_path / "task")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_perplexity_is_reported_only_for_the_tasks_own_loss(tmp_path):
    """val_ppl and val_bpb are exp and log2 of the task's cross-entropy: with a loss of the
    user's (label smoothing) they would be numbers of nothing, so the summary leaves them out."""
    base = [*LM, "batch=8", "trainer.max_steps=3"]
    task = run.run(cfg(tmp_path, *base, name="task"))
    mine = run.run(cfg(tmp_path, *base, "model.loss=own_losses:lm_smoothed", name="mine"))
    assert task["val_ppl"] is not None
    assert mine.get("val_ppl") is None and mine.get("val_bpb") is None
    assert mine["val_loss"] > 0 and mine["status"] == "completed"


@pytest.mark.parametrize(
    "loss, needle",
    [
        ("mine", r"model.loss='mine' is not allowed.*one of task, own, or package.module:fn"),
        ("own_losses:missing", r"model.loss='own_losses:missing': own_losses has no attribute"),
        ("own_losses:per_sample", r"returned torch.float32 \(16,\); it must return the batch"),
        ("own_losses:wrong_arguments", r"called as fn\(logits \(16, 4\), targets \(16,\)\), "),
    ],
)
def test_a_loss_that_cannot_be_used_is_a_config_error_naming_it(tmp_path, loss, needle):
    c = cfg(tmp_path, *CONV, "batch=16", "trainer.max_steps=2", f"model.loss={loss}")
    with pytest.raises(ConfigError, match=needle):
        validate(c)
        run.run(c)


def test_padding_is_left_out_of_the_loss_and_the_accuracy():
    """A tagger right on every real token and wrong on every padded one (-100) scores 1.0: the
    padding counts nowhere, and val/loss is the mean over the real tokens alone."""
    y = torch.tensor([[0, 2, 1, -100], [1, 1, -100, -100]])
    right = torch.nn.functional.one_hot(y.clamp(min=0), 3).float() * 4.0
    right[y == -100] = torch.tensor([0.0, 9.0, 0.0])  # confidently wrong where it is padding

    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return right + self.w

    model = Fixed()
    cfg = PrecisionConfig("fp32", "mixprec.precision.base", None, False, 1, [])
    prec = Precision(cfg, "cpu", GradScaler("cpu", enabled=False), False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = loop.Learner(model, opt, sched, prec, tasks.TagTokens(vocab=8))
    val = loop.evaluate(learner, [(torch.zeros(2, 4, dtype=torch.long), y)])
    expected = torch.nn.functional.cross_entropy(right[y != -100], y[y != -100])
    assert val["val/acc1"] == 1.0
    assert abs(val["val/loss"] - float(expected)) < 1e-6


@pytest.mark.slow
def test_token_classification_through_a_collator_and_workers_resumes_bit_exact(tmp_path):
    """Ragged token-classification samples, padded per batch by transformers' collator in two
    DataLoader workers, the batch's dict passed to the model by keyword: it learns the rule,
    and a resume from the step-6 checkpoint, with the workers changed (none), ends with the
    same weights as the run that never stopped."""
    pytest.importorskip("transformers")
    base = [*TAGS, "trainer.max_steps=12", "ckpt.every_steps=6", "ckpt.keep=3"]
    ref = run.run(cfg(tmp_path, *base, "hardware.num_workers=2", name="ref"))
    assert ref["status"] == "completed" and ref["task"] == "tag"
    half = tmp_path / "ref" / "checkpoints" / "step_00000006.pt"
    again = cfg(tmp_path, *base, "hardware.num_workers=0", f"resume={half}", name="again")
    assert run.run(again)["steps"] == 12
    a, b = last_weights(tmp_path / "ref"), last_weights(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    longer = run.run(cfg(tmp_path, *TAGS, "trainer.max_steps=60", name="longer"))
    assert longer["val_acc1"] > 0.9, longer


def test_inputs_by_keyword_reach_the_model_listed_or_all(tmp_path):
    """KeywordNet's forward requires input_ids and attention_mask by name: '**' passes every
    entry but the target, a list passes those named; naming an entry the samples lack lists
    the ones they have."""
    base = [*USER, "model.target=own_models:KeywordNet", "data.target=own_data:marked_masked"]
    base += ["batch=32", "trainer.max_steps=3"]
    for i, keys in enumerate(["**", "[input_ids,attention_mask]"]):
        s = run.run(cfg(tmp_path, *base, f"data.input_key={keys}", name=f"k{i}"))
        assert s["status"] == "completed" and s["task"] == "classify"
    with pytest.raises(ConfigError, match=r"keys \['attention_mask', 'input_ids', 'labels'\]"):
        run.run(cfg(tmp_path, *base, "data.input_key=[input_ids,mask]", name="bad"))
    with pytest.raises(ConfigError, match="data.input_key"):
        validate(cfg(tmp_path, *base, "data.input_key=[]", name="empty"))


@pytest.mark.slow
def test_bert_token_classification_learns_on_its_own_loss_through_the_collator(tmp_path):
    """transformers' BERT for token classification (model=hf, random init) on the collated,
    padded batches, given input_ids and attention_mask by keyword and trained on the loss it
    computes itself (padding -100 left out by it): it learns the rule."""
    pytest.importorskip("transformers")
    over = [
        *TINY_BERT,
        "model.loss=own",
        *USER,
        "data.target=own_data:tagged",
        "data.input_key=**",
        "batch=32",
        "trainer.max_steps=64",
        "optimizer.lr=0.003",
    ]
    s = run.run(cfg(tmp_path, *over))
    assert s["status"] == "completed" and s["task"] == "tag" and s["val_acc1"] > 0.9, s


@pytest.mark.slow
def test_a_hf_causal_lm_trained_on_its_own_loss_matches_the_tasks(tmp_path):
    """model=hf on token data with model.loss=own: the targets are already the next tokens, so
    they reach transformers' loss as shift_labels (not shifted again): the same losses as the
    task's cross-entropy, step for step."""
    pytest.importorskip("transformers")
    base = ["model=hf_llama_tiny", "data=text", "trainer.max_steps=4", "batch=4"]
    own = run.run(cfg(tmp_path, *base, "model.loss=own", name="own"))
    task = run.run(cfg(tmp_path, *base, name="task"))
    a, b = train_losses(tmp_path / "own"), train_losses(tmp_path / "task")
    assert len(a) == 4 and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)
    assert abs(own["val_loss"] - task["val_loss"]) < 1e-5


def test_the_python_entry_takes_a_loss_function(tmp_path):
    """mixprec.train(loss=fn): a function object, no module to import; the run trains on it."""
    import sys

    import mixprec

    sys.path.insert(0, str(PLUGINS))
    try:
        from own_data import blobs
        from own_losses import plus_ten
        from own_models import TinyConvNet
    finally:
        sys.path.remove(str(PLUGINS))
    over = [*SMALL, "batch=16", "trainer.max_steps=3"]
    mine = mixprec.train(TinyConvNet, blobs(), over, tmp_path / "mine", loss=plus_ten)
    task = mixprec.train(TinyConvNet, blobs(), over, tmp_path / "task")
    a, b = train_losses(tmp_path / "mine"), train_losses(tmp_path / "task")
    assert all(abs(x - y - 10.0) < 1e-3 for x, y in zip(a, b)), (a, b)
    assert mine["status"] == "completed" and abs(mine["val_loss"] - task["val_loss"] - 10) < 1e-3
    with pytest.raises(ConfigError, match=r"mixprec.train\(loss=...\) got int"):
        mixprec.train(TinyConvNet, blobs(), over, tmp_path / "bad", loss=3)


@pytest.mark.gpu
def test_collated_keyword_batches_train_on_the_gpu_with_workers_compiled(tmp_path):
    """On a GPU profile (DataLoader workers, pinned memory): the collator's dict batches reach
    the device entry by entry, compiled and in bf16 the tagger learns; batch=auto's probes
    take keyword inputs; model.cuda_graphs with inputs by keyword is refused, naming the key."""
    pytest.importorskip("transformers")
    gpu = ["hardware=auto", "logger=none", "trainer.log_every=10", "trainer.perf_warmup_steps=2"]
    over = [*gpu, *TAGS, "precision=bf16", "model.compile=true", "trainer.max_steps=60"]
    s = run.run(compose_cfg(over, tmp_path / "compiled"))
    assert s["status"] == "completed" and s["val_acc1"] > 0.9, s
    auto = [*gpu, *TAGS, "precision=bf16", "batch=auto", "trainer.max_steps=4"]
    searched = run.run(compose_cfg(auto, tmp_path / "auto"))  # probes with keyword inputs
    assert searched["status"] == "completed" and searched["batch"] >= 8, searched
    graphs = [*gpu, *TAGS, "model.cuda_graphs=true", "trainer.max_steps=2"]
    with pytest.raises(ConfigError, match="model.cuda_graphs=True.*keyword arguments"):
        run.run(compose_cfg(graphs, tmp_path / "graphs"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_collated_keyword_batches_train_under_torchrun(tmp_path, strategy):
    """2 processes (gloo): each rank collates its own share of the ragged samples in its
    workers and passes the dict by keyword; the run completes as one run of world 2 and its
    validation counts every rank's real tokens (the accuracy is a fraction of them)."""
    pytest.importorskip("transformers")
    args = [str(ROOT / "train.py"), *SMALL, *TAGS, "trainer.max_steps=8", "ckpt.at_end=false"]
    args += ["batch=16", "hardware.num_workers=1", f"parallel={strategy}"]
    two = run_torchrun([*args, f"hydra.run.dir={tmp_path / 'two'}"])
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    s = summary(tmp_path / "two")
    assert (s["status"], s["world_size"], s["effective_batch"], s["task"]) == (
        "completed",
        2,
        32,
        "tag",
    )
    assert 0 < s["val_acc1"] <= 1 and s["val_loss"] > 0
