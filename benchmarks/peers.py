"""mixprec against the loops users would write otherwise, side by side in one process tree on
whatever device is present: each side of a row is a fresh process, one after another on the
same GPU, and the table gives mixprec's rate over the peer's.

    python benchmarks/peers.py                         # lm_bf16, lm_fp8 (the 8B slice) on the GPU
    python benchmarks/peers.py --rows lm_bf16,lm_fp8,vision_amp --out benchmarks/results/peers
    python benchmarks/peers.py --tiny --rows lm_fp32,lm_bf16   # a CPU-sized model (the test's)

The peers (each runnable alone: `--side peer --row ROW`):
- lm_*: Hugging Face's LlamaForCausalLM from its config at the row's shape (four of
  Llama-3-8B's layers; --tiny: llama_tiny's), fused AdamW, bf16 autocast, each decoder layer
  compiled (on a GPU), random byte tokens; lm_fp8 converts its Linears with torchao's
  convert_to_float8_training (tensorwise, the lm_head left in bf16) as torchao's README does.
- torchtitan (lm rows, where it imports; --torchtitan): torchtitan's Llama 3 model with its own
  float8 converter, per-block compile, loss and clipping in its trainer's order (peer_torchtitan;
  its trainer itself needs its datasets and tokenizer downloads, which a GPU machine here lacks).
- vision_amp: Lightning with experiment=fast's recipe (ResNet-50, fp16 mixed precision,
  channels_last, torch.compile mode reduce-overhead, batch 512, synthetic images on the GPU).
mixprec's side is train.py with the documented preset (experiment=lm_table model=llama_8b_slice,
experiment=fast), its summary's steady-state rate. Writes peers.md and peers.json into --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLICE = dict(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim=14336)  # llama_8b_slice
TINY = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384)  # llama_tiny
ROWS = {  # row: (kind, precision)
    "lm_fp32": ("lm", "fp32"),
    "lm_bf16": ("lm", "bf16"),
    "lm_fp8": ("lm", "fp8"),
    "vision_amp": ("vision", "amp"),
}


def lm_shape(tiny: bool) -> dict:
    return dict(TINY if tiny else SLICE, seq=64 if tiny else 4096, batch=2, vocab=256)


def peer_lm(precision: str, steps: int, warmup: int, tiny: bool, device: str) -> dict:
    """The plain Hugging Face loop: tokens/s over `steps` after `warmup`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = lm_shape(tiny)
    cfg = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["dim"],
        intermediate_size=s["ffn_dim"],
        num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        max_position_embeddings=s["seq"],
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    if precision == "fp8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    gpu = device.startswith("cuda")
    if gpu:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=gpu)
    dtype = None if precision == "fp32" else torch.bfloat16
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)

    def step():
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return timed(step, steps, warmup, s, gpu)


def import_torchtitan():
    """torchtitan's Llama 3 model, compile, float8 and loss, without its data path: the
    package's __init__ imports its Hugging Face datasets loader (datasets, pyarrow, pandas:
    over 60 MB that cannot travel to a GPU machine without a registry), which no row uses."""
    import importlib
    import os
    import types

    import torchtitan

    here = os.path.join(os.path.dirname(torchtitan.__file__), "models", "llama3")
    pkg = types.ModuleType("torchtitan.models.llama3")
    pkg.__path__ = [here]  # its submodules, not its __init__
    sys.modules.setdefault("torchtitan.models.llama3", pkg)
    data = types.ModuleType("torchtitan.hf_datasets.text_datasets")  # (train_spec names it)

    def no_data(*args, **kwargs):
        raise RuntimeError("peers.py feeds torchtitan's model itself: no dataset loader")

    data.build_text_dataloader = data.build_text_validation_dataloader = no_data
    sys.modules.setdefault("torchtitan.hf_datasets.text_datasets", data)
    names = ("model.model", "model.args", "infra.parallelize")
    return [importlib.import_module(f"torchtitan.models.llama3.{n}") for n in names]


def peer_torchtitan(precision: str, steps: int, warmup: int, tiny: bool, device: str) -> dict:
    """torchtitan's own pieces, in its trainer's order on one GPU (torchtitan/train.py):
    its Llama 3 Transformer at the row's shape, its float8 converter (tensorwise, the output
    head left out, as its llama3 configs filter it), its per-block compile (apply_compile), its
    compiled sum-reduced loss over the token count, bf16 autocast (maybe_enable_amp: no FSDP on
    one GPU), its foreach grad clipping, fused AdamW with its defaults."""
    from importlib.metadata import version

    import torch

    model_mod, args_mod, parallelize = import_torchtitan()
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    s = lm_shape(tiny)
    args = args_mod.TransformerModelArgs(
        dim=s["dim"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        vocab_size=s["vocab"],
        multiple_of=128 if tiny else 1024,  # ffn 384 (tiny) and 14336 (Llama-3-8B's)
        ffn_dim_multiplier=None if tiny else 1.3,
        max_seq_len=s["seq"],
        rope_theta=500000,
    )
    gpu = device.startswith("cuda")
    jc = JobConfig()
    jc.compile.enable = gpu
    jc.quantize.linear.float8.filter_fqns = ["output"]
    torch.manual_seed(0)
    with torch.device(device):
        model = model_mod.Transformer(args)
    with torch.no_grad():
        model.init_weights()
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == s["ffn_dim"]
    if precision == "fp8":
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        Float8LinearConverter(jc, dims).convert(model)
    if gpu:
        parallelize.apply_compile(model, jc.compile)
    loss_fn = build_cross_entropy_loss(jc)
    o = jc.optimizer
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=gpu,
    )
    dtype = None if precision == "fp32" else torch.bfloat16
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    tokens = float(labels.numel())

    def step():
        opt.zero_grad()
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(inputs), labels) / tokens
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        opt.step()
        return loss

    rate = timed(step, steps, warmup, s, gpu)
    return {**rate, "version": version("torchtitan")}


def timed(step, steps: int, warmup: int, s: dict, gpu: bool) -> dict:
    """tokens/s of `step` over `steps` after `warmup`, and the last loss."""
    import torch

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    secs = time.perf_counter() - t
    return {"rate": steps * s["batch"] * s["seq"] / secs, "unit": "tokens/s", "loss": loss.item()}


def peer_vision(steps: int, warmup: int) -> dict:
    """Lightning, experiment=fast's recipe, synthetic images: img/s after `warmup` steps."""
    import lightning as L
    import timm
    import torch

    batch = 512

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = timm.create_model("resnet50", num_classes=1000)

        def training_step(self, b, i):
            x, y = b
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=True)

    class Synthetic(torch.utils.data.IterableDataset):
        def __iter__(self):
            x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (batch,), device="cuda")
            while True:
                yield x, y

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t = None

        def on_train_batch_start(self, trainer, module, b, i):
            if i == warmup:
                torch.cuda.synchronize()
                self.t = time.perf_counter()

    net = Net().to(memory_format=torch.channels_last)
    net.net = torch.compile(net.net, mode="reduce-overhead")
    clock = Clock()
    trainer = L.Trainer(
        max_steps=warmup + steps,
        precision="16-mixed",
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[clock],
    )
    loader = torch.utils.data.DataLoader(Synthetic(), batch_size=None)
    trainer.fit(net, loader)
    torch.cuda.synchronize()
    return {"rate": steps * batch / (time.perf_counter() - clock.t), "unit": "img/s"}


def mixprec_args(row: str, steps: int, warmup: int, tiny: bool) -> list[str]:
    kind, precision = ROWS[row]
    if kind == "vision":
        return ["experiment=fast", f"trainer.max_steps={steps + warmup}"]
    base = ["experiment=lm_table", "hydra.mode=RUN", f"precision={precision}", "logger=none"]
    base += [f"trainer.max_steps={steps + warmup}", f"trainer.perf_warmup_steps={warmup}"]
    base += ["debug.memory=false", f"trainer.log_every={max(1, steps // 4)}"]
    if tiny:  # llama_tiny's shape on a CPU: no compile, as the peer
        return [
            *base,
            "model=llama_tiny",
            "data.seq_len=64",
            "hardware=cpu",
            "needs_gpu=false",
            "model.compile=false",
            "data.epoch_sequences=2000",
            "data.val_sequences=2",
        ]
    return [*base, "model=llama_8b_slice"]


def run_side(side: str, row: str, a) -> dict:
    """One side of a row in a fresh process: the peer (this file, --side peer) or train.py."""
    with tempfile.TemporaryDirectory() as tmp:
        if side != "mixprec":
            out = Path(tmp) / "peer.json"
            cmd = [sys.executable, __file__, "--side", side, "--row", row, "--json", str(out)]
            cmd += ["--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device]
            cmd += ["--tiny"] if a.tiny else []
        else:
            cmd = [
                sys.executable,
                str(ROOT / "train.py"),
                *mixprec_args(row, a.steps, a.warmup, a.tiny),
            ]
            cmd += [f"hydra.run.dir={tmp}/run"]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            tail = (p.stdout + p.stderr)[-1500:]
            return {"error": f"exit {p.returncode}: {tail}", "wall_s": wall}
        if side != "mixprec":
            return {**json.loads(out.read_text()), "wall_s": wall}
        s = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        unit = "tokens/s" if s.get("tokens_per_s") else "img/s"
        rate = s.get("tokens_per_s") or s.get("samples_per_s")
        if rate is None:
            return {
                "error": "no steady-state rate in summary.json (too few steps?)",
                "wall_s": wall,
            }
        return {
            "rate": rate,
            "unit": unit,
            "mfu": s.get("mfu"),
            "first_step_s": s.get("first_step_s"),
            "wall_s": wall,
        }


# issue 89's goals, printed beside the rows they judge
GOALS = {"vs_torchtitan": 1.05, "fp8_over_bf16": 1.35, "mfu_bf16": 0.60}


def ratio(mine: dict, peer: dict | None) -> str:
    if not peer or "rate" not in peer or "rate" not in mine:
        return "-"
    return f"**{mine['rate'] / peer['rate']:.3f}**"


def cell(side: dict | None) -> str:
    if not side:
        return "-"
    if "rate" not in side:
        return side.get("error", "")[:80].replace("\n", " ").replace("|", "/")
    return f"{side['rate']:,.0f} {side['unit']}"


def table(results: dict) -> str:
    lines = [
        "| row | peer | torchtitan | mixprec | mixprec / peer | mixprec / torchtitan | "
        "mixprec MFU | wall s (peer, torchtitan, mixprec) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, r in results.items():
        peer, titan, mine = r["peer"], r.get("torchtitan"), r["mixprec"]
        mfu = "-" if mine.get("mfu") is None else f"{mine['mfu']:.3f}"
        walls = ", ".join(f"{x['wall_s']:.0f}" if x else "-" for x in (peer, titan, mine))
        lines.append(
            f"| {row} | {cell(peer)} | {cell(titan)} | {cell(mine)} | {ratio(mine, peer)} | "
            f"{ratio(mine, titan)} | {mfu} | {walls} |"
        )
    return "\n".join(lines) + "\n" + goals(results)


def goals(results: dict) -> str:
    """Each goal of issue 89 the rows measured, beside its value: met or missed."""
    out = []

    def judge(what: str, value: float, goal: float) -> None:
        out.append(
            f"- {what}: {value:.3f} (goal >= {goal}: {'met' if value >= goal else 'MISSED'})"
        )

    for row in ("lm_bf16", "lm_fp8"):
        mine, titan = results.get(row, {}).get("mixprec"), results.get(row, {}).get("torchtitan")
        if mine and titan and "rate" in mine and "rate" in titan:
            judge(
                f"{row} mixprec / torchtitan", mine["rate"] / titan["rate"], GOALS["vs_torchtitan"]
            )
    for side in ("peer", "torchtitan", "mixprec"):
        b, f = results.get("lm_bf16", {}).get(side), results.get("lm_fp8", {}).get(side)
        if b and f and "rate" in b and "rate" in f:
            value = f["rate"] / b["rate"]
            if side == "mixprec":
                judge("mixprec fp8 / bf16", value, GOALS["fp8_over_bf16"])
            else:
                out.append(f"- {side}: fp8 / bf16 = {value:.3f}")
    mine = results.get("lm_bf16", {}).get("mixprec")
    if mine and mine.get("mfu") is not None:
        judge("mixprec bf16 MFU", mine["mfu"], GOALS["mfu_bf16"])
    return ("\n" + "\n".join(out) + "\n") if out else ""


def device_note() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU, torch {torch.__version__}"


TITAN_INSTALL = (
    "pip install --no-deps torchtitan==0.2.2 torchdata tyro docstring-parser typeguard tensorboard"
)


def has_torchtitan() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchtitan") is not None


def checked(ap: argparse.ArgumentParser, a) -> list[str]:
    """The rows asked for; every bad argument one line from argparse (exit 2)."""
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: {unknown} not among {list(ROWS)}")
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0 (got {a.steps}, {a.warmup})")
    if a.device.startswith("cuda") or any(ROWS[r][0] == "vision" for r in rows):
        import torch

        if not torch.cuda.is_available():
            ap.error(
                f"--device {a.device} (the default) needs a CUDA GPU and none is visible; on a "
                "CPU: --tiny --device cpu --rows lm_fp32 (vision_amp needs a GPU)"
            )
    if a.torchtitan == "on" and not has_torchtitan():
        ap.error(f"--torchtitan on: torchtitan does not import here ({TITAN_INSTALL})")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="lm_bf16,lm_fp8", help=f"of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=30, help="timed steps a side")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timing")
    ap.add_argument("--tiny", action="store_true", help="llama_tiny's shape (a CPU)")
    ap.add_argument("--device", default="cuda", help="the peer's device (cuda or cpu)")
    ap.add_argument("--out", type=Path, default=None, help="folder for peers.md / peers.json")
    ap.add_argument(
        "--torchtitan",
        choices=("auto", "on", "off"),
        default="auto",
        help="torchtitan's side of the lm rows: auto runs it where torchtitan imports "
        f"({TITAN_INSTALL}), on requires it, off leaves it out",
    )
    ap.add_argument(
        "--hf",
        choices=("on", "off"),
        default="on",
        help="the Hugging Face loop's side of the lm rows (off: torchtitan and mixprec alone)",
    )
    ap.add_argument("--side", choices=("peer", "torchtitan"), help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        kind, precision = ROWS[a.row]
        if kind == "vision":
            got = peer_vision(a.steps, a.warmup)
        elif a.side == "torchtitan":
            got = peer_torchtitan(precision, a.steps, a.warmup, a.tiny, a.device)
        else:
            got = peer_lm(precision, a.steps, a.warmup, a.tiny, a.device)
        a.json.write_text(json.dumps(got))
        return
    rows = checked(ap, a)
    titan = a.torchtitan == "on" or (a.torchtitan == "auto" and has_torchtitan())
    results = {}
    for row in rows:  # the sides one after another: each alone on the device
        hf = a.hf == "on" or ROWS[row][0] != "lm"
        results[row] = {"peer": run_side("peer", row, a) if hf else None}
        if ROWS[row][0] == "lm" and titan:
            results[row]["torchtitan"] = run_side("torchtitan", row, a)
        results[row]["mixprec"] = run_side("mixprec", row, a)
        print(row, json.dumps(results[row]), flush=True)
    text = f"# mixprec against its peers ({device_note()}, {time.strftime('%Y-%m-%d')})\n\n"
    text += f"`python benchmarks/peers.py {' '.join(sys.argv[1:])}`\n\n" + table(results)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "peers.md").write_text(text)
        (a.out / "peers.json").write_text(json.dumps(results, indent=1))
    if any(side and "error" in side for r in results.values() for side in r.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
