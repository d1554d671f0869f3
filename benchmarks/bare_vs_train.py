"""train.py against a bare PyTorch loop doing the same work, side by side in one run.

    python benchmarks/bare_vs_train.py --preset cpu     # digits CNN on this CPU, fp32
    python benchmarks/bare_vs_train.py --preset gpu     # ResNet-50 224^2 synthetic, batch 256
    python benchmarks/bare_vs_train.py --preset gpu --matrix --gpus 0,1   # `make bench`
    python benchmarks/bare_vs_train.py --preset gpu --rows amp+cl+compile,bf16+cl+graphs@384
    python benchmarks/bare_vs_train.py --preset gpu --rows amp+cl --train-args scaler.guard_bn_stats=false
    python benchmarks/bare_vs_train.py --preset lm --rows bf16+compile,fp8+compile   # the Llama 8B slice

A row is `precision[+cl][+compile[:mode]][+opt:KEY]...[+graphs][@batch]` (precision: fp32, tf32,
amp, bf16, fp8, fp8_rowwise): channels_last,
torch.compile (and its mode, and inductor options set true, e.g. `+opt:conv_1x1_as_mm`), CUDA
graphs (torch.cuda.make_graphed_callables), the batch. `--matrix` is fp32, tf32,
amp, bf16 x channels_last off/on x compile off/on. Each side of a row is a fresh process on the
same GPU (rows spread over `--gpus`); warm-up excluded, the GPU synchronised at the timing
boundaries; each side times `--repeats` windows of `steps` steps and reports their median
(train.py: its per-window `perf/samples_per_s` from metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "cpu": dict(
        precisions=["fp32"],
        batch=64,
        steps=100,
        warmup=30,
        repeats=3,
        train_args=["hardware=cpu", "optimizer=sgd", "trainer.min_steps=0"],
    ),
    "gpu": dict(
        precisions=["fp32", "amp", "bf16"],
        batch=256,
        steps=20,
        warmup=20,
        repeats=3,
        train_args=["experiment=resnet50_synthetic"],
    ),
    # language models (docs/language-models.md): the same decoder, precision, conversion and
    # per-block compile on both sides; the bare loop feeds random tokens of the same shape
    "lm": dict(
        precisions=["bf16+compile", "fp8+compile"],
        batch=2,
        steps=10,
        warmup=10,
        repeats=3,
        train_args=[
            "model=llama_8b_slice",
            "data=text",
            "data.seq_len=4096",
            "data.epoch_sequences=100000",
            "model.compile_scope=blocks",
            "optimizer.scale_lr=none",
            "optimizer.lr=3e-4",
        ],
    ),
    "lm-cpu": dict(  # the same code path on a CPU, small (a smoke test, not a measurement)
        precisions=["fp32"],
        batch=4,
        steps=5,
        warmup=3,
        repeats=2,
        train_args=[
            "model=llama_tiny",
            "data=text",
            "data.seq_len=64",
            "data.max_mb=2",
            "hardware=cpu",
            "optimizer.scale_lr=none",
            "optimizer.lr=3e-4",
        ],
    ),
}


def parse_row(spec: str, batch: int) -> dict:
    head, _, b = spec.partition("@")
    prec, *flags = head.split("+")
    row = {
        "spec": spec,
        "precision": prec,
        "channels_last": "cl" in flags,
        "compile": None,
        "graphs": "graphs" in flags,
        "batch": int(b) if b else batch,
        "options": {f[4:]: True for f in flags if f.startswith("opt:")},
    }
    for f in flags:
        if f.startswith("compile"):
            row["compile"] = f.partition(":")[2] or "default"
    return row


def timed(step, batch: int, steps: int, warmup: int, repeats: int, sync) -> list[float]:
    """Samples/s of `repeats` windows of `steps` calls of step() after `warmup` calls, the
    device synchronised at each window's edges."""
    rates, t0 = [], time.perf_counter()
    for i in range(warmup + steps * repeats):
        if i >= warmup and (i - warmup) % steps == 0:
            sync()
            if i > warmup:
                rates.append(steps * batch / (time.perf_counter() - t0))
            t0 = time.perf_counter()
        step()
    sync()
    rates.append(steps * batch / (time.perf_counter() - t0))
    return rates


def bare(preset: str, row: dict, steps: int, warmup: int, repeats: int) -> dict:
    """The seeds' plain loop: autocast + GradScaler + SGD (+ the row's switches), nothing else."""
    import timm
    import torch
    import torch.nn.functional as F

    import mixprec.models  # noqa: F401  (registers mixprec_digits_cnn with timm)
    from mixprec.core.process import set_tf32
    from mixprec.precision import base as precisions
    from mixprec.run.config import compose_config, validate

    if preset.startswith("lm"):
        return bare_lm(preset, row, steps, warmup, repeats)
    cuda, batch = preset == "gpu", row["batch"]
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = cuda
    # the precision's own settings and conversion (train.py's plugin): its autocast dtype, its
    # TF32 switch, and e.g. fp8's torchao conversion with the same layer filter
    c = validate(compose_config([f"precision={row['precision']}"]))
    prec = precisions.build(c.precision, c.scaler, device)
    set_tf32(c.precision.tf32)
    dtype = prec.dtype
    fmt = torch.channels_last if row["channels_last"] else torch.contiguous_format
    if cuda:
        model = timm.create_model(row["model"], num_classes=1000).to(device, memory_format=fmt)
        model = prec.convert(model)
        data = [
            (
                torch.randn(batch, 3, 224, 224, device=device).contiguous(memory_format=fmt),
                torch.randint(0, 1000, (batch,), device=device),
            )
        ]
        batches = lambda: iter(data * 10**9)  # noqa: E731  (the same batch every step)
    else:
        from torch.utils.data import DataLoader, TensorDataset

        from mixprec.data.digits import tensors
        from mixprec.run.config import compose_config, validate

        x, y, _, _ = tensors(validate(compose_config()).data)
        model = timm.create_model("mixprec_digits_cnn", num_classes=10, in_chans=1).to(device)
        model(x[:1])  # materialise the lazy head
        loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
        batches = lambda: (b for _ in range(10**9) for b in loader)  # noqa: E731
    opt = torch.optim.SGD(
        model.parameters(),
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-5,
        **({"fused": True} if cuda else {}),
    )
    if cuda:  # as train.py (optim.zero_momentum): safe when GradScaler skips the first step
        for p in model.parameters():
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    autocast = lambda: torch.autocast(
        device.type,
        dtype=dtype or torch.bfloat16,  # noqa: E731
        enabled=dtype is not None,
        cache_enabled=not row["graphs"],
    )
    if row["compile"]:
        from mixprec.compile.compiling import compile_model

        model = compile_model(
            model, None if row["compile"] == "default" else row["compile"], row["options"]
        )
    if row["graphs"]:
        with autocast():
            model = torch.cuda.make_graphed_callables(model, (data[0][0],))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    it = batches()
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        x, y = next(it)
        with autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    rates = timed(step, batch, steps, warmup, repeats, sync)
    peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else None
    return {"samples_per_s": statistics.median(rates), "windows": rates, "peak_mem_gib": peak}


def bare_lm(preset: str, row: dict, steps: int, warmup: int, repeats: int) -> dict:
    """A plain loop over the Llama decoder: autocast + GradScaler + fused AdamW, the model
    converted by the precision as train.py does, each block compiled in place."""
    import timm
    import torch
    import torch.nn.functional as F

    import mixprec.models  # noqa: F401  (registers mixprec_llama with timm)
    from mixprec.compile import compiling
    from mixprec.core.process import set_tf32
    from mixprec.precision import base as precisions
    from mixprec.run.config import compose_config, validate

    c = validate(compose_config([*PRESETS[preset]["train_args"], f"precision={row['precision']}"]))
    device = torch.device("cuda" if torch.cuda.is_available() and preset == "lm" else "cpu")
    torch.manual_seed(0)
    prec = precisions.build(c.precision, c.scaler, device)
    set_tf32(c.precision.tf32)
    seq, batch = c.data.seq_len, row["batch"]
    with device:
        model = timm.create_model(
            c.model.name, num_classes=256, max_seq_len=seq, **dict(c.model.kwargs)
        )
    model = prec.convert(model)
    if row["compile"]:
        compiling.compile_blocks(model, c.model.label, None, {})
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, **({"fused": True} if device.type == "cuda" else {})
    )
    scaler = torch.amp.GradScaler(device.type, enabled=prec.dtype is torch.float16)
    x = torch.randint(0, 256, (batch, seq), device=device)
    y = torch.randint(0, 256, (batch, seq), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        with torch.autocast(
            device.type, dtype=prec.dtype or torch.bfloat16, enabled=prec.dtype is not None
        ):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    rates = timed(step, batch, steps, warmup, repeats, sync)
    peak = torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None
    return {"samples_per_s": statistics.median(rates), "windows": rates, "peak_mem_gib": peak}


def via_train_py(
    preset: str, row: dict, steps: int, warmup: int, repeats: int, env: dict | None = None
) -> dict:
    with tempfile.TemporaryDirectory() as d:
        args = [
            sys.executable,
            str(ROOT / "train.py"),
            *PRESETS[preset]["train_args"],
            *row.get("train_args", []),
            f"precision={row['precision']}",
            f"batch={row['batch']}",
            "logger=none",
            f"model.channels_last={str(row['channels_last']).lower()}",
            f"model.compile={str(bool(row['compile'])).lower()}",
            f"model.cuda_graphs={str(row['graphs']).lower()}",
            f"trainer.max_steps={warmup + steps * repeats}",
            f"trainer.log_every={steps}",
            f"trainer.perf_warmup_steps={warmup}",
            f"hydra.run.dir={d}",
        ]
        if row["compile"] and row["compile"] != "default":
            args.append(f"model.compile_mode={row['compile']}")
        args += [f"+model.compile_options.{k}=true" for k in row["options"]]
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"train.py failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(d) / "summary.json").read_text())
        rows = [json.loads(l) for l in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    rates = [
        r["perf/samples_per_s"]
        for r in rows
        if "perf/samples_per_s" in r and r.get("step", 0) > warmup
    ]
    return {
        "samples_per_s": statistics.median(rates) if rates else s["samples_per_s"],
        "windows": rates,
        "steady_samples_per_s": s["samples_per_s"],
        "peak_mem_gib": s["peak_mem_gib"],
        "mfu": s["mfu"],
    }


def in_subprocess(preset, row, steps, warmup, repeats, env=None) -> dict:
    code = (
        f"import json,sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        f"import bare_vs_train as b; print(json.dumps(b.bare({preset!r}, {row!r}, "
        f"{steps}, {warmup}, {repeats})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(preset: str, row: dict, p: dict, gpu: str | None) -> dict:
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    out = dict(row, gpu=gpu)
    try:  # wall_s: each side's whole process, compile included
        t0 = time.perf_counter()
        b = in_subprocess(preset, row, p["steps"], p["warmup"], p["repeats"], env)
        b["wall_s"] = round(time.perf_counter() - t0, 1)
        if p.get("bare_only"):
            return dict(out, bare=b, bare_samples_per_s=b["samples_per_s"])
        t0 = time.perf_counter()
        t = via_train_py(preset, row, p["steps"], p["warmup"], p["repeats"], env)
        t["wall_s"] = round(time.perf_counter() - t0, 1)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return dict(out, error=str(e)[-1500:])
    mfu = t["mfu"] * b["samples_per_s"] / t["steady_samples_per_s"] if t["mfu"] else None
    return dict(
        out,
        bare=b,
        train=t,
        bare_samples_per_s=b["samples_per_s"],
        train_samples_per_s=t["samples_per_s"],
        ratio=t["samples_per_s"] / b["samples_per_s"],
        bare_mfu=mfu,
        train_mfu=t["mfu"],
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| row | bare img/s | train.py img/s | train.py / bare | peak GiB bare / train.py "
        "| MFU bare / train.py |",
        "|---|---|---|---|---|---|",
    ]
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['spec']} | error: {r['error'].splitlines()[-1][:80]} | | | | |")
            continue
        if "train" not in r:  # --bare-only
            lines.append(
                f"| {r['spec']} | {r['bare_samples_per_s']:,.0f} | - | - | "
                f"{f(r['bare']['peak_mem_gib'], '.2f')} / - | - |"
            )
            continue
        lines.append(
            f"| {r['spec']} | {r['bare_samples_per_s']:,.0f} | "
            f"{r['train_samples_per_s']:,.0f} | {r['ratio']:.3f} | "
            f"{f(r['bare']['peak_mem_gib'], '.2f')} / {f(r['train']['peak_mem_gib'], '.2f')} | "
            f"{f(r['bare_mfu'], '.3f')} / {f(r['train_mfu'], '.3f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--repeats", type=int, help="timed windows per side (median reported)")
    ap.add_argument("--precisions", help="comma list, e.g. fp32,amp,bf16")
    ap.add_argument(
        "--matrix", action="store_true", help="precisions x channels_last off/on x compile off/on"
    )
    ap.add_argument(
        "--compile",
        choices=["both", "off", "on"],
        default="both",
        help="with --matrix: only the rows without/with compile",
    )
    ap.add_argument("--rows", help="comma list of row specs (see the module docstring)")
    ap.add_argument(
        "--model",
        default="resnet50",
        help="gpu preset: the timm model of both sides (e.g. vit_base_patch16_224 for "
        "fp8 rows: ResNet-50's only Linear layer is its head)",
    )
    ap.add_argument(
        "--bare-only",
        action="store_true",
        help="time only the bare loop (to compare switches quickly)",
    )
    ap.add_argument("--gpus", help="GPU ids to spread rows over: 0,1 or all (default: one)")
    ap.add_argument(
        "--train-args",
        default="",
        help="extra train.py overrides for every row, space-separated, e.g. "
        "'scaler.guard_bn_stats=false' (the bare loop is unchanged)",
    )
    ap.add_argument("--out", type=Path, help="JSON results file")
    a = ap.parse_args()
    p = dict(PRESETS[a.preset])
    p["repeats"] = a.repeats or p["repeats"]
    p["bare_only"] = a.bare_only
    precisions = a.precisions.split(",") if a.precisions else p["precisions"]
    if a.rows:
        specs = a.rows.split(",")
    elif a.matrix:
        precisions = a.precisions.split(",") if a.precisions else ["fp32", "tf32", "amp", "bf16"]
        comp = {"both": ["", "+compile"], "off": [""], "on": ["+compile"]}[a.compile]
        specs = [f"{pr}{cl}{c}" for c in comp for pr in precisions for cl in ("", "+cl")]
    else:
        specs = precisions
    model_args = [f"model.name={a.model}"] if a.preset == "gpu" else []
    rows_in = [
        dict(
            parse_row(sp, p["batch"]),
            model=a.model,
            train_args=[*a.train_args.split(), *model_args],
        )
        for sp in specs
    ]
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": gpu,
        "torch": torch.__version__,
        "preset": a.preset,
        "steps_per_window": p["steps"],
        "warmup": p["warmup"],
        "windows": p["repeats"],
        "command": " ".join(["python3", *sys.argv]),
    }
    out = a.out or ROOT / "outputs" / "bench" / f"bare_vs_train-{a.preset}-{meta['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.gpus == "all":  # one worker per visible GPU (rows never share a GPU)
        a.gpus = ",".join(str(i) for i in range(max(1, torch.cuda.device_count())))
    gpus = a.gpus.split(",") if a.gpus else [None]
    todo: queue.Queue = queue.Queue()
    for i, r in enumerate(rows_in):
        todo.put((i, r))
    done: dict[int, dict] = {}
    lock = threading.Lock()

    def worker(g):
        while True:
            try:
                i, r = todo.get_nowait()
            except queue.Empty:
                return
            res = measure(a.preset, r, p, g)
            with lock:
                done[i] = res
                msg = res.get("error", "").splitlines()[-1:] or [
                    f"bare {res['bare_samples_per_s']:,.1f}"
                    + (
                        f"  train.py {res['train_samples_per_s']:,.1f}  ratio {res['ratio']:.3f}"
                        if "train" in res
                        else ""
                    )
                ]
                where = "on the CPU" if g is None else f"on gpu {g}"
                print(f"  [{r['spec']} {where}] {msg[0]}", flush=True)
                out.write_text(
                    json.dumps({"meta": meta, "rows": [done[k] for k in sorted(done)]}, indent=2)
                )

    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [done[k] for k in sorted(done)]
    print(
        f"\n{meta['date']} {gpu} torch {torch.__version__}, preset {a.preset}, "
        f"median of {p['repeats']} windows of {p['steps']} steps after {p['warmup']}"
    )
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
