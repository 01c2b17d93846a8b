"""The execution plan (minillm/runner/plan.py): every path's verdict and reason, decided once from the config, the
model, the KV spec, the dtype and plain device facts (so a made-up sm_90 GPU runs on the CPU); the kernel families'
coverage declarations against their C++ launchers; and a failed graph capture leaving the process usable."""
import dataclasses
import itertools
import re
import types
from pathlib import Path

import pytest
import torch

from minillm.ops.build import CUDA_DIR
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError, EngineConfig
from minillm.model.loader import resolve_arch
from minillm.ops import attention_ops, build, choice, fused_ops, gemm_ops
from minillm.ops import decode_gemm as dg
from minillm.ops import megakernel as mk
from minillm.runner import cuda_graphs
from minillm.runner.plan import LINEAR_LAYERS, PATHS, DeviceInfo, ExecutionPlan, resolve_plan, torch_plan

H200 = DeviceInfo("cuda", (9, 0), 132, 232448)
A100 = DeviceInfo("cuda", (8, 0), 108, 166912)
B200 = DeviceInfo("cuda", (10, 0), 148, 232448)
CPU = DeviceInfo("cpu")
CUDA_SRC = CUDA_DIR
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(autouse=True)
def extension_loads(monkeypatch):
    """The CUDA extension 'loads' (nothing is built): the plan's logic is what is tested."""
    monkeypatch.setattr(build, "load_extension", lambda: object())


def plan(model="qwen3-0.6b", device=H200, arch=None, **kw) -> ExecutionPlan:
    kw.setdefault("dtype", "bfloat16")
    cfg = EngineConfig.from_kwargs(model, **kw)
    arch = arch or resolve_arch(model)
    dtype = DTYPES[cfg.model.dtype]
    spec = KVCacheSpec.for_model(arch, cfg.cache.block_size, cfg.cache.kv_cache_dtype, dtype)
    return resolve_plan(cfg, arch, spec, dtype, device)


def verdicts(p: ExecutionPlan) -> dict:
    return {name: getattr(p, name).on for name in PATHS}


def test_qwen3_on_an_h200_takes_every_kernel_path():
    p = plan(max_num_seqs=8)
    assert all(verdicts(p).values()), p.describe()
    assert p.attention_backend == "cuda" and p.megakernel_rows == 8
    # decode-sized o_proj [1024, 2048] and down_proj [1024, 3072]: skinny; the wide qkv and gate_up: cuBLAS
    assert {n for n, v in p.skinny_gemm.items() if v.on} == {"o_proj", "down_proj"}
    assert "4096" in p.skinny_gemm["qkv_proj"].reason and p.notices == ()
    mkern = p.model_kernels()
    assert mkern.cuda and mkern.skinny_for("o_proj") and not mkern.skinny_for("qkv_proj")


def test_record_keeps_the_former_keys_and_adds_every_verdict():
    rec = plan().record()
    assert set(rec) >= {"cuda_ops", "attention", "attention_mode", "skinny_gemm", "decode_min_partitions",
                        "decode_ctas_per_sm", "megakernel_max_batch", "megakernel_max_tokens",
                        "megakernel_min_chunks", "pdl", "unavailable", "cuda_graphs", "plan"}
    assert (rec["cuda_ops"], rec["attention"], rec["megakernel_max_batch"], rec["pdl"]) == (True, "cuda", 16, True)
    assert set(rec["plan"]) == set(PATHS) | {"skinny_gemm", "decode_gemm", "moe", "prefill_kernel"}
    assert set(rec["plan"]["skinny_gemm"]) == set(rec["plan"]["decode_gemm"]) == set(LINEAR_LAYERS)
    assert rec["plan"]["prefill_kernel"] == "wgmma"   # H200
    assert all(v["reason"] for k, v in rec["plan"].items() if k not in ("skinny_gemm", "decode_gemm",
                                                                        "prefill_kernel"))
    assert all(set(v) == {"on", "reason", "max_rows"} and v["reason"] for v in rec["plan"]["decode_gemm"].values())


@pytest.mark.parametrize("kw,why", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(block_size=8), "block_size=8"),
    (dict(block_size=64), "block_size=64"),
])
def test_uncovered_attention_runs_torch_and_eager_and_says_so_once(kw, why):
    """The three configurations that crashed in graph capture: the plan never captures a torch-attention path."""
    p = plan(**kw)
    assert not p.attention.on and why in p.attention.reason
    assert not p.cuda_graphs.on and "host" in p.cuda_graphs.reason
    assert not p.megakernel.on and not p.fused_kv_write.on
    assert p.step_path(True, [5, 7]) == "eager"
    assert len(p.notices) == 1 and why in p.notices[0] and "without CUDA graphs" in p.notices[0]
    assert p.fused_ops.on   # the fused kernels cover float32 too, and any block size


@pytest.mark.parametrize("kw,key", [
    (dict(kernels="cuda", dtype="float32"), "model.dtype"),
    (dict(kernels="cuda", block_size=8), "cache.block_size"),
    (dict(attention="cuda", block_size=64), "cache.block_size"),
])
def test_forced_cuda_on_an_uncovered_config_is_a_config_error_naming_the_key(kw, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as e:
        plan(**kw)
    assert "kernels.backend=auto" in str(e.value)


def test_enforce_eager_turns_graphs_and_the_megakernel_off_quietly():
    p = plan(enforce_eager=True)
    assert not p.cuda_graphs.on and p.cuda_graphs.reason == "runtime.enforce_eager=true"
    assert not p.megakernel.on and "graphs" in p.megakernel.reason and p.attention.on and p.notices == ()
    assert plan(enforce_eager=True, dtype="float32").notices == (
        "attention runs on the torch path (the CUDA attention kernels do not cover dtype float32 (covered: bfloat16, "
        "float16))",)


def test_an_a100_keeps_attention_and_graphs_but_not_the_sm90_kernels():
    p = plan(device=A100)
    assert p.attention.on and p.cuda_graphs.on and p.fused_ops.on
    assert not p.pdl.on and "sm_90" in p.pdl.reason
    assert not any(v.on for v in p.skinny_gemm.values()) and "sm_90" in p.skinny_gemm["o_proj"].reason
    assert not p.megakernel.on and "sm_90" in p.megakernel.reason


def test_torch_backend_and_cpu_run_nothing_of_ours():
    for p in (plan(kernels="torch"), plan(attention="torch"), plan(device=CPU, dtype="float32")):
        assert not any(verdicts(p).values()) and not any(v.on for v in p.skinny_gemm.values())
        assert p.record()["cuda_ops"] is False
    assert "without CUDA graphs" in plan(kernels="torch").notices[0]   # on a GPU, eager is said once
    assert plan(device=CPU, dtype="float32").notices == ()
    with pytest.raises(ConfigError, match="need a CUDA device"):
        plan(device=CPU, dtype="float32", kernels="cuda")
    k = plan(attention="torch", kernels="cuda")       # attention alone on torch
    assert k.fused_ops.on and not k.attention.on and not k.megakernel.on and not k.cuda_graphs.on


def test_qwen2_bias_and_width_are_decided_per_layer():
    p = plan("qwen2.5-0.5b")
    assert not p.skinny_gemm["qkv_proj"].on and "bias" in p.skinny_gemm["qkv_proj"].reason
    assert p.skinny_gemm["o_proj"].on and not p.megakernel.on and "granules" in p.megakernel.reason
    assert p.attention.on and p.cuda_graphs.on


def test_knobs_switch_their_path_off():
    assert not any(v.on for v in plan(skinny_gemm=False).skinny_gemm.values())
    assert not plan(megakernel=False).megakernel.on and not plan(pdl=False).pdl.on
    assert plan(megakernel_max_batch=4).megakernel_rows == 4 and plan(max_num_seqs=2).megakernel_rows == 2


def test_step_path():
    p = plan(megakernel_max_tokens=100)
    assert p.step_path(True, [10, 20]) == "megakernel"
    assert p.step_path(True, [60, 60]) == "graph"            # over megakernel_max_tokens
    assert p.step_path(True, [1] * 17) == "graph"            # over the megakernel's rows
    assert p.step_path(False, [10, 20]) == "eager"           # a prefill in the step
    off = p.without_graphs("capturing failed")
    assert off.step_path(True, [10]) == "eager" and off.record()["megakernel_max_batch"] == 0
    assert off.record()["plan"]["cuda_graphs"] == {"on": False, "reason": "capturing failed"}


def test_a_build_failure_under_auto_is_recorded(monkeypatch, capsys):
    def broken():
        raise build.ExtensionError("nvcc not found")

    monkeypatch.setattr(build, "load_extension", broken)
    monkeypatch.setattr(choice, "_warned", set())
    p = plan()
    assert not any(verdicts(p).values()) and p.unavailable == "nvcc not found"
    assert "nvcc not found" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="nvcc not found"):
        plan(kernels="cuda")


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_every_config_of_the_matrix_resolves_or_is_refused_naming_a_key(model):
    """The start-up matrix's axes on a fake H200: each case gets a consistent plan or a ConfigError naming a key,
    and no plan captures graphs over a path that is not graph-safe."""
    seen = set()
    for dtype, bs, kernels, eager, prefix in itertools.product(DTYPES, (8, 16, 32, 64), ("auto", "cuda", "torch"),
                                                               (True, False), (True, False)):
        try:
            p = plan(model, dtype=dtype, block_size=bs, kernels=kernels, enforce_eager=eager,
                     enable_prefix_caching=prefix)
        except ConfigError as e:
            assert kernels == "cuda" and re.match(r"(model\.dtype|cache\.block_size): ", str(e)), str(e)
            seen.add("refused")
            continue
        seen.add("graphs" if p.cuda_graphs.on else "eager")
        assert not p.cuda_graphs.on or (p.attention.on and attention_ops.COVERAGE.graph_safe)
        assert not p.megakernel.on or (p.cuda_graphs.on and p.attention.on)
        assert not p.fused_kv_write.on or (p.attention.on and p.fused_ops.on)
        assert p.cuda_graphs.on == (not eager and kernels != "torch" and dtype != "float32" and bs in (16, 32))
        assert all(getattr(p, n).reason for n in PATHS)
    assert seen == {"refused", "graphs", "eager"}


def test_torch_plan_is_plain_torch():
    p = torch_plan()
    assert not any(verdicts(p).values()) and p.model_kernels().cuda is False


def test_device_info_of_the_cpu():
    assert DeviceInfo.of(torch.device("cpu")) == CPU and CPU.sm == "cpu" and H200.sm == "sm_90"


# ---- the declarations agree with the C++ launchers ------------------------------------------------------------

def _src(name: str) -> str:
    return (CUDA_SRC / name).read_text()


def _const(name: str, text: str) -> int:
    return int(re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)", text).group(1))


def test_attention_declaration_matches_its_launchers():
    cov = attention_ops.COVERAGE
    decode = _src("paged_decode.cu")
    pairs = {(int(d), int(b)) for d, b in re.findall(r"a\.head_dim == (\d+) && a\.block_size == (\d+)", decode)}
    assert pairs == set(itertools.product(cov.head_dims, cov.block_sizes))
    assert _const("kMaxGroup", decode) == cov.max_gqa_group
    prefill = {int(d) for d in re.findall(r"a\.head_dim == (\d+)", _src("paged_prefill.cu"))}
    assert set(cov.head_dims) <= prefill
    assert all(b & (b - 1) == 0 for b in cov.block_sizes)           # prefill: any power of two
    dtype_code = re.search(r"dtype_code\(const Tensor& t\) \{(.*?)\n\}", _src("attention_bindings.cpp"), re.S)
    assert _aten_dtypes(dtype_code.group(1)) == set(cov.dtypes)


def test_fused_declaration_matches_its_launchers():
    fused_h, bindings = _src("fused.h"), _src("fused_bindings.cpp")
    assert _const("kMaxNormHidden", fused_h) == fused_ops.MAX_NORM_HIDDEN
    assert _const("kMaxHeadDim", fused_h) == fused_ops.MAX_HEAD_DIM
    assert _const("kMaxVocab", fused_h) - 4 == fused_ops.MAX_VOCAB
    act = re.search(r"ScalarType act_dtype\(.*?\) \{(.*?)\n\}", bindings, re.S).group(1)
    assert _aten_dtypes(act) == set(fused_ops.COVERAGE.dtypes)


def test_skinny_gemm_declaration_matches_its_launcher():
    gemm_h, bindings, kernel = _src("gemm.h"), _src("fused_bindings.cpp"), _src("skinny_gemm.cu")
    assert (_const("kGemmTileN", gemm_h), _const("kGemmTileK", gemm_h)) == (gemm_ops.TILE_N, gemm_ops.TILE_K)
    assert _const("kGemmMaxSplits", gemm_h) == max(gemm_ops.SPLITS)
    body = re.search(r"Tensor skinny_gemm\(.*?\n\}", bindings, re.S).group(0)
    assert "dtype != ScalarType::kFloat32" in body and "float32" not in gemm_ops.COVERAGE.dtypes
    assert {int(s) for s in re.findall(r"splits == (\d+)", body)} == set(gemm_ops.SPLITS)
    assert "__CUDA_ARCH__ >= 900" in kernel and gemm_ops.COVERAGE.min_capability == (9, 0)


def test_megakernel_declaration_matches_its_launcher():
    h, cu, bindings = _src("megakernel.h"), _src("decode_megakernel.cu"), _src("megakernel_bindings.cpp")
    assert (_const("kMegaMaxBatch", h), _const("kMegaMaxHidden", h), _const("kMegaMaxGranules", h),
            _const("kMegaMaxLayers", h)) == (mk.MAX_BATCH, mk.MAX_HIDDEN, mk.MAX_GRANULES, mk.MAX_LAYERS)
    assert "(D != 64 && D != 128)" in cu and mk.COVERAGE.head_dims == (64, 128)
    assert "Hq / Hkv > 16" in cu and mk.COVERAGE.max_gqa_group == 16
    assert "if (major < 9) return cudaErrorNotSupported" in cu and mk.COVERAGE.min_capability == (9, 0)
    chunk = _const("kChunk", cu)
    assert all(b >= chunk and b & (b - 1) == 0 for b in mk.COVERAGE.block_sizes)   # the launcher's pow2_bs
    assert "dt == at::kBFloat16 || dt == at::kHalf" in bindings and set(mk.COVERAGE.dtypes) == {"bfloat16", "float16"}


def _aten_dtypes(code: str) -> set[str]:
    names = {"kBFloat16": "bfloat16", "kHalf": "float16", "kFloat": "float32"}
    return {names[m] for m in re.findall(r"at::(kBFloat16|kHalf|kFloat)\b", code)}


# ---- a failed capture leaves the process usable (torch.cuda mocked) ------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    calls = types.SimpleNamespace(set_stream=[], synchronize=0, ended=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "stream0")
    monkeypatch.setattr(torch.cuda, "set_stream", calls.set_stream.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: setattr(calls, "synchronize", calls.synchronize + 1))
    monkeypatch.setattr(cuda_graphs, "end_generator_capture", lambda: setattr(calls, "ended", calls.ended + 1))
    return calls


def test_guarded_capture_restores_the_stream_and_the_generator(fake_cuda):
    assert cuda_graphs.guarded_capture(lambda: None, "decode CUDA graphs") is None
    assert (fake_cuda.set_stream, fake_cuda.ended) == ([], 0)

    def fails():
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    reason = cuda_graphs.guarded_capture(fails, "decode CUDA graphs")
    assert reason == ("capturing the decode CUDA graphs failed: RuntimeError: operation not permitted when stream "
                      "is capturing")
    assert (fake_cuda.set_stream, fake_cuda.synchronize, fake_cuda.ended) == (["stream0"], 1, 1)


def test_a_failed_capture_leaves_the_runner_eager_and_says_so_once(fake_cuda, caplog):
    from minillm.runner.model_runner import ModelRunner

    def fails():
        raise RuntimeError("Offset increment outside graph capture")

    runner = types.SimpleNamespace(plan=plan(), megakernel=object(), graphs="g", mega_graphs=None,
                                   _capture_graphs=fails, _capture_megakernel=lambda: None)
    with caplog.at_level("ERROR"):
        ModelRunner._capture_all(runner)
    assert runner.graphs is None and runner.megakernel is None and runner.mega_graphs is None
    assert not runner.plan.cuda_graphs.on and "Offset increment" in runner.plan.cuda_graphs.reason
    assert runner.plan.step_path(True, [3]) == "eager"
    assert len([r for r in caplog.records if "serves decode steps eagerly" in r.getMessage()]) == 1


# ---- on a GPU: every declared case runs, an undeclared one is refused ------------------------------------------

def _decode_and_prefill(dtype, head_dim, hq, hkv, block_size):
    from minillm.diagnostics import paged_meta
    from minillm.ops.reference import make_paged_batch

    b = make_paged_batch([33, 5], [1, 5], hq, hkv, head_dim, block_size, dtype, "cuda", seed=1)
    kc, vc, meta = b.k_cache.clone(), b.v_cache.clone(), paged_meta(b, num_decodes=1)
    attention_ops.kv_write(b.k, b.v, kc, vc, b.slot_mapping)
    out = torch.empty_like(b.q)
    attention_ops.paged_decode(out[:1], b.q[:1], kc, vc, b.block_tables[:1], b.seq_lens[:1], 0.1, meta.max_seq_len)
    attention_ops.paged_prefill(out, b.q, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, 0.1,
                                meta.max_query_len, seq_begin=1, num_seqs=1)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_attention_kernels_accept_every_declared_case(monkeypatch):
    monkeypatch.undo()   # the real extension
    build.load_extension()
    cov = attention_ops.COVERAGE
    for dt, d, bs, group in itertools.product(cov.dtypes, cov.head_dims, cov.block_sizes, (1, cov.max_gqa_group)):
        out = _decode_and_prefill(DTYPES[dt], d, 2 * group, 2, bs)
        assert torch.isfinite(out[: 6].float()).all(), (dt, d, bs, group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,hq,hkv,block_size", [
    (torch.float32, 128, 2, 2, 16), (torch.bfloat16, 96, 2, 2, 16), (torch.bfloat16, 128, 2, 2, 8),
    (torch.bfloat16, 128, 34, 2, 16)])
def test_attention_kernels_refuse_an_undeclared_case(monkeypatch, dtype, head_dim, hq, hkv, block_size):
    monkeypatch.undo()
    build.load_extension()
    assert attention_ops.COVERAGE.reason(dtype=str(dtype)[6:], capability=(9, 0), head_dim=head_dim,
                                         num_q_heads=hq, num_kv_heads=hkv, block_size=block_size) is not None
    with pytest.raises(RuntimeError):
        _decode_and_prefill(dtype, head_dim, hq, hkv, block_size)


@pytest.mark.gpu
def test_skinny_gemm_accepts_its_dtypes_and_refuses_float32(monkeypatch):
    monkeypatch.undo()
    build.load_extension()
    if gemm_ops.COVERAGE.reason(dtype="bfloat16", capability=torch.cuda.get_device_capability()) is not None:
        pytest.skip("the skinny GEMM needs sm_9x")
    for dt in gemm_ops.COVERAGE.dtypes:
        x, w = torch.randn(4, 1024, device="cuda", dtype=DTYPES[dt]), torch.randn(1024, 1024, device="cuda",
                                                                                   dtype=DTYPES[dt])
        torch.testing.assert_close(gemm_ops.linear(x, w, skinny=True).float(), (x.float() @ w.float().T),
                                   atol=0.5, rtol=2e-2)
    x = torch.randn(4, 1024, device="cuda")
    with pytest.raises((ValueError, RuntimeError)):
        gemm_ops.linear(x, torch.randn(1024, 1024, device="cuda"), skinny=True)


_POISON = """
import torch
from minillm.runner.cuda_graphs import guarded_capture

x = torch.ones(1, device="cuda")

def bad():
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.item()                     # a host sync under capture: the failure the plan now rules out

reason = guarded_capture(bad, "test graphs")
assert reason.startswith("capturing the test graphs failed"), reason
torch.randn(4, device="cuda")        # raised 'Offset increment outside graph capture' while the generator stayed
y = torch.zeros(4, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y.add_(torch.rand(4, device="cuda") * 0 + 1)
g.replay()
torch.cuda.synchronize()
assert y.tolist() == [1.0] * 4, y
print("usable")
"""


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_process_usable_on_a_gpu():
    """A real failed capture (a host sync inside it), then random numbers and a new capture in the same process
    (in a child process, so a failure cannot spoil the GPU tests after this one)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _POISON], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and "usable" in proc.stdout, proc.stderr[-3000:]


# ---- the decode GEMM: covers() and the measured-win table, per linear layer -------------------------------------

WINS = {(1024, 2048): 16, (1024, 3072): 16}   # Qwen3-0.6B's o_proj and down_proj


@pytest.fixture
def wins(monkeypatch):
    """A table where the kernel 'won' on Qwen3-0.6B's o_proj and down_proj up to 16 rows."""
    monkeypatch.setattr(dg, "MEASURED_WINS", dict(WINS))


def decode_on(p: ExecutionPlan) -> dict[str, int]:
    return {n: v.max_rows for n, v in p.decode_gemm.items() if v.on}


def test_the_shipped_table_decides_the_decode_gemm():
    """Each layer's verdict follows MEASURED_WINS: on exactly where it names the layer's shape."""
    p = plan()
    shapes = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
    assert decode_on(p) == {n: dg.MEASURED_WINS[s] for n, s in shapes.items() if s in dg.MEASURED_WINS}
    for n, s in shapes.items():
        if s not in dg.MEASURED_WINS:
            assert "measured no faster" in p.decode_gemm[n].reason and p.decode_gemm[n].max_rows == 0


QWEN3_17B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28)   # no preset ships it


@pytest.mark.parametrize("model,shape,on", [("qwen3-0.6b", {}, {"o_proj": 16, "down_proj": 16}),
                                            ("qwen3-0.6b", QWEN3_17B, {}), ("qwen3-8b", {}, {})])
def test_decode_gemm_verdicts_per_model_shape(wins, model, shape, on):
    p = plan(model, arch=dataclasses.replace(resolve_arch(model), **shape))
    assert decode_on(p) == on
    for name, v in p.decode_gemm.items():
        assert v.reason and (name in on or "measured no faster" in v.reason), (name, v)
    assert p.cuda_graphs.on   # the kernel is declared graph-safe
    mk_ = p.model_kernels()
    assert {n: mk_.decode_rows_for(n) for n in LINEAR_LAYERS} == {n: on.get(n, 0) for n in LINEAR_LAYERS}


def test_decode_gemm_goes_first_and_the_record_and_log_line_carry_it(wins):
    p = plan()
    assert p.decode_gemm["o_proj"].reason == "[1024, 2048] at up to 16 rows (measured faster than cuBLAS and the " \
        f"skinny GEMM, {dg.MEASURED_AT})"
    assert p.skinny_gemm["o_proj"].on   # both on: gemm_ops.linear puts the decode GEMM first
    rec = p.record()
    assert rec["decode_gemm"] is True
    assert rec["plan"]["decode_gemm"]["o_proj"] == {"on": True, "reason": p.decode_gemm["o_proj"].reason,
                                                    "max_rows": 16}
    assert rec["plan"]["decode_gemm"]["qkv_proj"]["on"] is False
    assert "decode_gemm=o_proj,down_proj" in p.describe() and "skinny_gemm=o_proj,down_proj" in p.describe()


@pytest.mark.parametrize("kw,device,words", [
    (dict(decode_gemm=False), H200, "kernels.decode_gemm=false"),
    (dict(), A100, "needs sm_90 to sm_9x"),
    (dict(), B200, "the GPU is sm_100"),
    (dict(dtype="float32"), H200, "dtype float32"),
    (dict(kernels="torch"), H200, "kernels.backend=torch"),
])
def test_decode_gemm_off_says_why(wins, kw, device, words):
    p = plan(device=device, **kw)
    assert decode_on(p) == {} and all(words in v.reason for v in p.decode_gemm.values()), p.decode_gemm
    assert p.record()["decode_gemm"] is False and p.model_kernels().decode_rows_for("o_proj") == 0
    assert "decode_gemm=off" in p.describe()


def test_decode_gemm_keeps_to_what_covers_takes(monkeypatch):
    """A table entry the kernel cannot serve stays off with covers()' reason; a layer with a bias stays off."""
    monkeypatch.setattr(dg, "MEASURED_WINS", {(1024, 2048): 65, (1152, 896): 16})
    assert not plan().decode_gemm["o_proj"].on and "rows must be in [1, 64]" in plan().decode_gemm["o_proj"].reason
    q = plan("qwen2.5-0.5b").decode_gemm["qkv_proj"]   # [1152, 896] with the Qwen2 bias
    assert not q.on and "bias" in q.reason


def test_graphs_need_the_decode_gemm_to_be_graph_safe(wins, monkeypatch):
    monkeypatch.setattr(dg, "COVERAGE", dataclasses.replace(dg.COVERAGE, graph_safe=False))
    p = plan()
    assert not p.cuda_graphs.on and "decode_gemm is not graph-safe" in p.cuda_graphs.reason
    assert plan(decode_gemm=False).cuda_graphs.on


def test_decode_gemm_key_takes_only_a_bool():
    with pytest.raises(ConfigError, match=r"kernels\.decode_gemm='yes' has the wrong type"):
        EngineConfig.from_kwargs("qwen3-0.6b", decode_gemm="yes")


def test_the_sm90a_families_cover_major_9_only():
    """The extension embeds sm_90a and sm_80 machine code plus compute_80 PTX; the skinny and decode GEMM bodies are
    guarded by __CUDA_ARCH__ >= 900, so a newer GPU would JIT the PTX into kernels that write nothing."""
    # A new target here (sm_100 code, say) is when the two declarations' max_major must be revisited.
    targets = set(re.findall(r"arch=\w+,code=(\w+)", Path(build.__file__).read_text()))
    assert targets == {"sm_90a", "sm_80", "compute_80"}
    for src in ("skinny_gemm.cu", "decode_gemm.cu"):
        assert "__CUDA_ARCH__ >= 900" in _src(src)
    for cov in (gemm_ops.COVERAGE, dg.COVERAGE):
        assert cov.max_major == 9 and cov.min_capability == (9, 0)
        assert cov.reason(dtype="bfloat16", capability=(9, 0)) is None
        assert cov.reason(dtype="bfloat16", capability=(9, 4)) is None
        for cap in ((8, 0), (8, 9), (10, 0), (12, 0)):
            assert "needs sm_90 to sm_9x" in cov.reason(dtype="bfloat16", capability=cap)
    p = plan(device=B200)
    assert not any(v.on for v in p.skinny_gemm.values()) and "sm_100" in p.skinny_gemm["o_proj"].reason
