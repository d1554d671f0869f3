"""benchmarks/profile_step.py's reading of a profile: kernels by the names cuBLAS, torchao,
flash attention and inductor give them, and the step set against its FLOPs at the dense peak."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location(
        "profile_step", ROOT / "benchmarks" / "profile_step.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "kernel, group",
    [  # the first nine as one H100 (torch 2.11, torchao 0.18) named them in the 8B slice's step
        ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "fp8 GEMM"),
        ("nvjet_sm90_qqtst_320x128_128x3_1x2_h_bz_coopB_TNT", "fp8 GEMM"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM, bf16"),
        (
            "triton_poi_fused__fused_rms_norm__scaled_mm__to_copy_add_clamp_mul_reciprocal_t_view_16",
            "fp8 scaling",
        ),
        ("triton_red_fused_abs_max_mul_silu_silu_backward_view_4", "fp8 scaling"),
        (
            "triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3",
            "inductor reductions",
        ),
        ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_2", "inductor pointwise"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1",
            "attention",
        ),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
            "(anonymous namespace)::FusedOptimizerTensorListMetadata<4>",
            "optimizer",
        ),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "fp8 GEMM"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "GEMM, bf16"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor reductions"),
        ("triton_poi_fused_mul_silu_1", "inductor pointwise"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>", "cross-entropy"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("Memcpy DtoD (Device -> Device)", "copies"),
        ("some_kernel_nobody_named", "other"),
    ],
)
def test_an_lm_steps_kernels_fall_in_their_groups(prof, kernel, group):
    assert prof.group_of(kernel, prof.LM_GROUPS).startswith(group)


def test_record_function_ranges_on_the_gpu_timeline_are_not_counted_as_kernels(prof):
    # Kineto puts Optimizer.step#AdamW.step on the GPU's timeline spanning the fused AdamW
    # kernel: counted as a kernel, the optimizer's 9.3 ms on the H100 read as 19 ms
    cuda, cpu = prof.torch.autograd.DeviceType.CUDA, prof.torch.autograd.DeviceType.CPU

    def event(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation)

    ev = [
        event("Optimizer.step#AdamW.step", cuda, annotation=True),
        event("multi_tensor_apply_kernel", cuda),
        event("aten::mm", cpu),
        event("nvjet_sm90_tst_256x128", cuda),
    ]
    assert [e.name for e in prof.device_kernels(ev)] == [
        "multi_tensor_apply_kernel",
        "nvjet_sm90_tst_256x128",
    ]


def test_the_step_is_set_against_its_flops_at_the_dense_peak(prof):
    parts = SimpleNamespace(flops_per_sample=6e12, peak_tflops=1000.0)
    groups = {"GEMM, bf16/fp32": 9.0, "attention (flash)": 3.0, "inductor pointwise": 5.0}
    r = prof.roofline(parts, 2, 20.0, groups)  # 1.2e13 FLOPs at 1e15 FLOP/s: 12 ms
    assert r["roofline_ms_per_step"] == 12.0 and r["mfu_profiled"] == 0.6
    assert r["matmul_kernel_ms"] == 12.0 and r["matmul_kernels_at_peak"] == 1.0
    assert (
        prof.roofline(SimpleNamespace(flops_per_sample=None, peak_tflops=None), 2, 20.0, {}) == {}
    )


@pytest.mark.slow
def test_the_lm_profile_runs_a_tiny_decoder_on_the_cpu(tmp_path):
    out = tmp_path / "p.json"
    args = ["--groups", "lm", "--base", "model=llama_tiny", "data=text", "hardware=cpu"]
    args += ["data.seq_len=32", "batch=2", "model.compile=false", "--warmup", "1", "--steps", "2"]
    args += ["--profile-steps", "1", "--out", str(out)]
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    got = json.loads(out.read_text())
    # tokens/s is batch x seq_len over the timed step (both rounded: to 1 and to 0.01 ms)
    assert (
        abs(got["tokens_per_s"] - 2 * 32 / got["step_ms"] * 1e3) <= 0.5 + 1e-3 * got["tokens_per_s"]
    )
    assert "tokens/s" in p.stdout


def profile_step(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,said",
    [
        ([], "experiment=fast"),  # its GPU preset on this CPU
        (["--steps", "0"], "--steps and --profile-steps must be >= 1"),
        (["--profile-steps", "0"], "--steps and --profile-steps must be >= 1"),
        (["--base", "hardware=cpu", "precision=fp9"], "precision"),
        (["--out", "/proc/self/nothere/p.json"], "its folder cannot be written"),
    ],
    ids=["cpu-default", "steps-0", "profile-steps-0", "bad-override", "unwritable-out"],
)
def test_a_bad_command_is_one_line_and_exit_2(args, said):
    """Issue 90, item 15: each of these was a traceback."""
    if not args and __import__("torch").cuda.is_available():
        pytest.skip("the default preset runs where a GPU is")
    p = profile_step(*args)
    assert p.returncode == 2 and said in p.stderr, (p.stdout + p.stderr)[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_more_steps_than_an_epoch_go_on_into_the_next(tmp_path):
    """Issue 90, item 15: digits has 23 batches an epoch; 20 + 10 + 2 steps took more than
    one and ended in StopIteration's traceback."""
    out = tmp_path / "p.json"
    p = profile_step(
        "--base",
        "hardware=cpu",
        "--warmup",
        "20",
        "--steps",
        "10",
        "--profile-steps",
        "2",
        "--out",
        str(out),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert json.loads(out.read_text())["step_ms"] > 0
