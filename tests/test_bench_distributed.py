"""benchmarks/bench_distributed.py without a GPU: arguments, configurations, the implementation list,
round statistics, efficiency / ratio / bar arithmetic on synthetic timings, the model column, rendering,
the NVLink-multicast environment; and (``-m distributed``) a whole CPU gloo run of two processes."""

import ast
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_distributed.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_distributed as bd  # noqa: E402


@pytest.fixture(autouse=True)
def no_torchrun_env(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DASH_FA3_COMMIT"):
        monkeypatch.delenv(v, raising=False)


# ------------------------------------------------------------------------------------------ arguments


def test_cpu_defaults_time_ours_only():
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--heads", "2/2"])
    assert args.backend == "gloo" and args.peers == []
    assert all(im.ours for im in bd.implementations(args))
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--peers", "flash", "--rotate", "alltoall",
                          "--modes", "det", "--layouts", "zigzag"])
    assert [im.name for im in bd.implementations(args)] == [
        "ours T1 det", "SDPA flash T1", "ours CP det zigzag", "torch CP flash alltoall"]


@pytest.mark.parametrize("text, value", [("65536", 65536), ("64k", 65536), ("128K", 131072), ("1m", 1048576),
                                         (" 2048 ", 2048)])
def test_sizes(text, value):
    assert bd.parse_size(text) == value


@pytest.mark.parametrize("text", ["0", "-64k", "64q", "k", "", "1.5k"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="positive size"):
        bd.parse_size(text)


def test_heads():
    assert bd.parse_heads("32/8") == (32, 8) and bd.parse_heads("16") == (16, 16) and bd.parse_heads("8/1") == (8, 1)
    for bad in ("32/5", "a/b", "1/2/3", "0/0", "16/"):
        with pytest.raises(ValueError):
            bd.parse_heads(bad)


def test_size_labels():
    assert [bd.size_label(n) for n in (65536, 131072, 1048576, 2048, 1000)] == ["64k", "128k", "1M", "2k", "1000"]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1000"], "1000 tokens is not a multiple of 2*P*128 = 512 (P = 2)"),
    (["--tokens", "1536", "--nproc", "4"], "not a multiple of 2*P*128 = 1024 (P = 4)"),
    (["--tokens", "64q"], "positive size"),
    (["--heads", "32/5"], "multiple of heads_kv"),
    (["--modes", "nd,fast"], "--modes: unknown fast"),
    (["--layouts", "ring"], "--layouts: unknown ring"),
    (["--peers", "sdpa"], "--peers: unknown sdpa"),
    (["--rotate", "ring"], "--rotate: unknown ring"),
    (["--rotate", ""], "--rotate needs at least one method"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["--tokens", ""], "need at least one value"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--causal", "--full"], "not allowed with argument"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bd.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{bd.PROG}: error: ") and message in err


def test_torchrun_world_size_decides_the_token_check(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert bd.world_size_hint(bd.parse_args(["--tokens", "1024"])) == 4
    with pytest.raises(SystemExit):
        bd.parse_args(["--tokens", "1536"])   # fine for --nproc 2, not for 4 ranks
    assert bd.tokens_problem(2048, 8) is None and bd.tokens_problem(3072, 4) is None
    assert bd.tokens_problem(3072, 8) == "3072 tokens is not a multiple of 2*P*128 = 2048 (P = 8)"
    assert bd.tokens_problem(1536, 4) is not None


# ------------------------------------------------------------------------------------------ statistics


def test_rotation_puts_each_implementation_first_once():
    names = ["a", "b", "c", "d"]
    orders = [bd.rotated(names, r) for r in range(len(names))]
    assert [o[0] for o in orders] == names
    assert all(sorted(o) == names for o in orders)
    assert bd.rotated(names, 1) == ["b", "c", "d", "a"] and bd.rotated(names, 5) == bd.rotated(names, 1)
    assert bd.rotated([], 3) == []


def test_round_stats_are_medians_of_round_medians():
    st = bd.round_stats([[3.0, 1.0, 2.0], [10.0], [], [5.0, 7.0]])
    assert st["rounds"] == [2.0, 10.0, 6.0]
    assert (st["median"], st["min"], st["max"]) == (6.0, 2.0, 10.0)
    assert bd.round_stats([]) is None and bd.round_stats([[], []]) is None


def test_call_time_is_the_slowest_rank():
    assert bd.call_time([12.0, 15.5]) == 15.5 and bd.call_time([3.0]) == 3.0


def test_efficiency_and_ratio():
    assert bd.efficiency(100.0, 62.5, 2) == pytest.approx(0.8)
    assert bd.efficiency(100.0, 25.0, 4) == pytest.approx(1.0)
    assert bd.efficiency(None, 10.0, 2) is None and bd.efficiency(10.0, None, 2) is None
    assert bd.efficiency(10.0, 0.0, 2) is None
    assert bd.ratio(3.0, 4.0) == 0.75 and bd.ratio(3.0, None) is None and bd.ratio(None, 4.0) is None
    assert bd.ratio(1.0, 0.0) is None


def test_classify():
    assert bd.classify(None) is None
    assert bd.classify(NotImplementedError("deterministic CP on CUDA")) == "not available"
    assert bd.classify(torch.OutOfMemoryError("CUDA out of memory")) == "OOM"
    assert bd.classify(RuntimeError("boom")) == "error"
    assert bd.one_line(ValueError("first\nsecond")) == "ValueError: first"


def test_max_abs_diff_in_chunks_matches_the_whole():
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(2, 100, 3, 8, generator=g), torch.randn(2, 100, 3, 8, generator=g)
    d, m = bd.max_abs_diff(x.bfloat16(), r.bfloat16(), chunk=7)
    assert d == (x.bfloat16().float() - r.bfloat16().float()).abs().max().item()
    assert m == r.bfloat16().float().abs().max().item()
    assert bd.max_abs_diff(x, x)[0] == 0.0
    assert bd.max_abs_diff(x[:, :50], r)[0] == float("inf") and bd.max_abs_diff(None, r)[0] == float("inf")


# ------------------------------------------------------------------------------------------ figures


def synthetic(args_extra=()):
    args = bd.parse_args(["--tokens", "128k", "--heads", "32/8", *args_extra])
    cfg = bd.configs(args)[0]
    impls = bd.implementations(args)
    ms = {"ours T1 nd": 450.0, "ours T1 det": 500.0, "SDPA cuDNN T1": 460.0, "SDPA flash T1": 700.0,
          "ours CP nd contiguous": 230.0, "ours CP nd zigzag": 240.0,
          "ours CP det contiguous": 250.0, "ours CP det zigzag": None,
          "torch CP cuDNN allgather": 245.0, "torch CP cuDNN alltoall": 240.0,
          "torch CP flash allgather": 200.0, "torch CP flash alltoall": 400.0}
    return args, cfg, impls, ms


def test_figures_use_the_right_single_gpu_time():
    args, cfg, impls, ms = synthetic()
    models = {("contiguous", 1): {"eff": 0.85, "ms": 270.0, "t1_ms": 920.0}, ("zigzag", 1): {"eff": 0.81, "ms": 280.0}}
    fig = bd.figures(impls, ms, 2, models)
    rows = fig["rows"]
    assert not any(name.startswith(("ours T1", "SDPA")) for name in rows)   # T1 rows have no efficiency
    # ours: T1 of the same mode
    assert rows["ours CP nd contiguous"]["eff_ours"] == pytest.approx(450 / (2 * 230))
    assert rows["ours CP det contiguous"]["eff_ours"] == pytest.approx(500 / (2 * 250))
    assert rows["ours CP det zigzag"]["eff_ours"] is None                  # no timing
    # everyone against cuDNN T1
    assert rows["ours CP det contiguous"]["eff_cudnn"] == pytest.approx(460 / (2 * 250))
    assert rows["torch CP cuDNN allgather"]["eff_cudnn"] == pytest.approx(460 / (2 * 245))
    # torch CP: ours T1 nd, and its own backend's T1
    assert rows["torch CP flash allgather"]["eff_ours"] == pytest.approx(450 / (2 * 200))
    assert rows["torch CP flash allgather"]["eff_own"] == pytest.approx(700 / (2 * 200))
    assert rows["torch CP cuDNN alltoall"]["eff_own"] == pytest.approx(460 / (2 * 240))
    # the model sits beside ours det only
    assert rows["ours CP det contiguous"]["model"]["eff"] == 0.85
    assert rows["ours CP det contiguous"]["model_minus_measured"] == pytest.approx(0.85 - 1.0)
    assert "model" not in rows["ours CP nd contiguous"] and "model" not in rows["torch CP cuDNN alltoall"]
    assert "model_minus_measured" not in rows["ours CP det zigzag"]
    # ratios: ours / peer, a full matrix
    assert fig["ratios"]["ours CP nd zigzag"]["torch CP cuDNN alltoall"] == pytest.approx(1.0)
    assert fig["ratios"]["ours CP nd contiguous"]["torch CP flash alltoall"] == pytest.approx(230 / 400)
    assert fig["ratios"]["ours CP det zigzag"]["torch CP flash allgather"] is None
    assert set(fig["ratios"]) == {im.name for im in impls if im.kind == "cp_ours"}
    # the fastest cuDNN rotate method, even though flash allgather is faster still
    assert (fig["best_cudnn"], fig["best_cudnn_ms"]) == ("torch CP cuDNN alltoall", 240.0)


def test_transport_variants_are_rows_of_their_own():
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--heads", "2/2", "--cp-transports",
                          "p2p:1,shared:2"])
    names = [im.name for im in bd.implementations(args)]
    assert "ours CP det zigzag p2p x1" in names and "ours CP det zigzag shared x2" in names
    assert "ours CP nd zigzag" in names and not any(n.startswith("ours CP nd") and " x" in n for n in names)
    cfg = bd.configs(args)[0]
    models = bd.det_models(args, cfg, 2)
    assert sorted(models) == [("contiguous", 1), ("contiguous", 2), ("zigzag", 1), ("zigzag", 2)]
    shared_row = next(im for im in bd.implementations(args) if im.name == "ours CP det contiguous shared x2")
    assert shared_row.model_key == ("contiguous", 2)
    before = {n: os.environ.get(n) for n in ("DASH_FA3_CP_TRANSPORT", "DASH_FA3_CP_CHUNKS")}
    with bd.transport_env(shared_row):
        assert os.environ["DASH_FA3_CP_TRANSPORT"] == "shared" and os.environ["DASH_FA3_CP_CHUNKS"] == "2"
    assert {n: os.environ.get(n) for n in before} == before
    for bad in ("nccl:2", "shared", "shared:0", "p2p:1,p2p:1"):
        with pytest.raises(SystemExit):
            bd.parse_args(["--device", "cpu", "--tokens", "2048", "--cp-transports", bad])


def test_t1_prefix_and_flop_ratio():
    args = bd.parse_args(["--tokens", "128k,512k", "--heads", "16/16", "--t1-tokens", "131072"])
    short, long_ = bd.configs(args)
    assert bd.t1_prefix(args, short) is None and bd.t1_prefix(args, long_) == 131072
    assert bd.flop_ratio(long_, 131072) == pytest.approx(524288 * 524289 / (131072 * 131073))
    assert bd.flop_ratio(dict(long_, causal=False), 131072) == 16.0
    for bad in ("-128", "1000"):
        with pytest.raises(SystemExit):
            bd.parse_args(["--t1-tokens", bad])


def test_figures_without_peers_or_t1():
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--heads", "2/2"])
    impls = bd.implementations(args)
    fig = bd.figures(impls, {im.name: (None if im.single else 5.0) for im in impls}, 2)
    assert fig["best_cudnn"] is None and all(r["eff_ours"] is None and r["eff_cudnn"] is None
                                             for r in fig["rows"].values())
    assert fig["ratios"] == {im.name: {} for im in impls if im.kind == "cp_ours"}


def test_bar_per_mode_and_size():
    args, cfg, impls, ms = synthetic()
    ms.update({"ours CP nd contiguous": 236.0, "ours CP nd zigzag": 250.0, "ours CP det contiguous": 251.0,
               "ours CP det zigzag": 253.0, "ours T1 det": 480.0})
    models = {("contiguous", 1): {"eff": 0.99}, ("zigzag", 1): {"eff": 0.89}}
    fig = bd.figures(impls, ms, 2, models)
    bar = {b["impl"]: b for b in bd.bar_rows(cfg, impls, ms, fig)}
    assert [b for b in bar] == ["ours CP nd contiguous", "ours CP nd zigzag", "ours CP det contiguous",
                                "ours CP det zigzag"]
    nd, det = bar["ours CP nd contiguous"], bar["ours CP det contiguous"]
    assert nd["eff_target"] == 0.95 and nd["eff"] == pytest.approx(450 / 472) and nd["eff_ok"] is True
    assert bar["ours CP nd zigzag"]["eff_ok"] is False                        # 450 / 500 = 0.90 < 0.95
    # ratio to the fastest cuDNN CP (240 ms): nd must not be slower, det may be 5% slower
    assert nd["vs_cudnn"] == pytest.approx(236 / 240) and nd["vs_ok"] is True
    assert bar["ours CP nd zigzag"]["vs_ok"] is False                          # 250 / 240 = 1.042 > 1.00
    assert det["vs_cudnn"] == pytest.approx(251 / 240) and det["vs_ok"] is True    # 1.046 <= 1.05
    assert bar["ours CP det zigzag"]["vs_ok"] is False                          # 1.054 > 1.05
    # the model within 0.05 of the measured efficiency, det rows only
    assert det["model_diff"] == pytest.approx(0.99 - 480 / 502) and det["model_ok"] is True
    assert bar["ours CP det zigzag"]["model_ok"] is False and nd["model_ok"] is None
    # other sizes have no efficiency target; a CPU run gets no verdicts
    cfg64 = dict(cfg, tokens=65536)
    assert bd.bar_rows(cfg64, impls, ms, fig)[0]["eff_target"] == 0.90
    assert bd.bar_rows(dict(cfg, tokens=262144), impls, ms, fig)[0]["eff_ok"] is None
    cpu = bd.bar_rows(cfg, impls, ms, fig, gpu=False)
    assert all(b[k] is None for b in cpu for k in ("eff_ok", "vs_ok", "model_ok"))
    assert cpu[0]["eff"] == nd["eff"]


def test_model_prediction_is_the_head_parallel_model():
    from dash_fa3.distributed import heads as cp_heads

    cfg = bd.configs(bd.parse_args(["--tokens", "128k", "--heads", "32/8"]))[0]
    for layout in ("contiguous", "zigzag"):
        m = bd.model_prediction(cfg, 2, layout)
        r = cp_heads.simulate(2, 131072, causal=True, layout=layout, heads=32, heads_kv=8)
        assert m["eff"] == pytest.approx(r.efficiency) and m["ms"] == pytest.approx(r.time_ms)
        assert 0.5 < m["eff"] < 1.0
        # calibrated: the model's one-GPU time is the measured one
        cal = bd.model_prediction(cfg, 2, layout, t1_ms=2 * r.single_ms)
        assert cal["t1_ms"] == pytest.approx(2 * r.single_ms) and cal["eff"] > m["eff"]
    assert "P <= 64" in bd.model_prediction(cfg, 128, "contiguous")["unavailable"]
    assert "unavailable" in bd.model_prediction(dict(cfg, tokens=1000), 2, "zigzag")
    assert "KV heads cannot be shared" in bd.model_prediction(cfg, 16, "zigzag")["unavailable"]


# ------------------------------------------------------------------------------------------ rendering


META = {"world_size": 2, "backend": "nccl", "torch": "2.11.0", "cudnn": 91000, "nccl": "2.27.3",
        "device": "NVIDIA H200", "device_type": "cuda", "date": "2026-11-23T10:00:00", "commit": "abc1234",
        "rounds": 3, "iters": 1, "warmup": 1, "check_tol": 0.05}


def synthetic_record():
    args, cfg, impls, ms = synthetic()
    rec = {"config": cfg, "impls": {}}
    for im in impls:
        if ms[im.name] is None:
            rec["impls"][im.name] = {"status": "not available", "error": "rank 0: NotImplementedError: det on CUDA"}
        else:
            rec["impls"][im.name] = {"status": "ok", "stats": bd.round_stats([[ms[im.name]], [ms[im.name] + 2]]),
                                     "check": {"diff": {"out": 1e-3, "dq": 2e-3, "dk": 3e-3, "dv": 4e-3},
                                               "ref_max": {"out": 1.0, "dq": 1.0, "dk": 1.0, "dv": 1.0}}}
    rec["impls"]["torch CP cuDNN allgather"]["note"] = "k/v expanded from 8 to 32 heads"
    rec["impls"]["torch CP flash alltoall"]["check"]["diff"]["dq"] = 0.5
    rec["impls"]["ours T1 nd"]["check"] = {"is_reference": True}
    med = {n: (r["stats"]["median"] if r.get("stats") else None) for n, r in rec["impls"].items()}
    models = {("contiguous", 1): {"eff": 0.85, "ms": 271.0}, ("zigzag", 1): {"unavailable": "ValueError: nope"}}
    rec["figures"] = bd.figures(impls, med, 2, models)
    rec["bar"] = bd.bar_rows(cfg, impls, med, rec["figures"])
    rec["peer_layout"] = "the same tokens as our zigzag layout on every rank"
    return rec, impls


def test_section_table():
    rec, impls = synthetic_record()
    text = "\n".join(bd.section_lines(rec, impls, 0.05))
    assert "## GQA 32/8, 128k tokens (batch 1, hdim 128, bf16, causal)" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| ours CP det contiguous |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # each figure is the median of two rounds (x, x + 2): ms 251, ours T1 det 501, cuDNN T1 461
    assert cells[1:8] == ["251.0", "250.0–252.0", f"{501 / 502:.2f}", f"{461 / 502:.2f}", "271.0", "0.85",
                          "out 1.0e-03, dq 2.0e-03, dk 3.0e-03, dv 4.0e-03"]
    assert "| ours CP det zigzag | not available |" in text
    assert "- ours CP det zigzag: not available: rank 0: NotImplementedError: det on CUDA" in text
    assert "- ours CP det zigzag: no model prediction" not in text           # no timing: no model note needed
    assert "| ours T1 nd | 451.0 |" in text and "| reference |" in text
    assert "WARN " in next(line for line in lines if line.startswith("| torch CP flash alltoall |"))
    assert "dq 5.0e-01!" in text
    assert "- torch CP cuDNN allgather: k/v expanded from 8 to 32 heads" in text
    # the ratio table: ours rows, torch CP columns
    assert "| ours \\ torch CP | cuDNN allgather | cuDNN alltoall | flash allgather | flash alltoall |" in text
    assert f"| nd contiguous | {231 / 246:.2f} | {231 / 241:.2f} | {231 / 201:.2f} | {231 / 401:.2f} |" in text
    assert "| det zigzag | n/a | n/a | n/a | n/a |" in text
    assert "torch CP shards: the same tokens as our zigzag layout" in text


def test_skipped_configuration_and_bar_table():
    rec, impls = synthetic_record()
    skipped = {"config": dict(rec["config"], tokens=65536), "skipped": "OOM: inputs: rank 1: OutOfMemoryError: x"}
    assert bd.section_lines(skipped, impls, 0.05)[-1] == "not run: OOM: inputs: rank 1: OutOfMemoryError: x"
    bar = "\n".join(bd.bar_lines([rec, skipped]))
    assert re.search(r"^## .*bar$", bar, re.M) and "no verdicts" not in bar
    rows = [line for line in bar.splitlines() if line.startswith("| GQA")]
    assert len(rows) == 4                                                  # the skipped one has none
    det = [c.strip() for c in rows[2].strip("|").split("|")]
    assert det[:7] == ["GQA 32/8, 128k tokens", "det contiguous", f"{501 / 502:.2f}", "pass",
                       f"{251 / 241:.2f}", "pass", "0.85"]
    assert det[7] == f"{0.85 - 501 / 502:+.2f}" and det[8] == "FAIL"
    assert "no verdicts" in "\n".join(bd.bar_lines([rec], gpu=False))


def test_render_names_device_torch_date_commit():
    rec, impls = synthetic_record()
    text = bd.render(META, [rec], impls)
    head = text.splitlines()[:5]
    assert head[0] == "# dash_fa3 context parallelism, forward + backward: P = 2 ranks"
    assert "NVIDIA H200 x2 (nccl), torch 2.11.0" in head[2] and "2026-11-23" in head[2] and "abc1234" in head[2]
    assert "CUDA-event" in text and "max over ranks" in text and "medians over rounds" in text
    assert text.index("## GQA 32/8") < re.search(r"^## .*bar$", text, re.M).start()   # sections, then the bar
    assert "perf_counter" in "\n".join(bd.header_lines(dict(META, device_type="cpu")))


def test_dry_run(capsys):
    assert bd.main(["--dry-run", "--tokens", "64k", "--heads", "16/16"]) == 0
    out = capsys.readouterr().out
    assert "P = 2, device cuda, backend nccl" in out and "torch CP cuDNN alltoall" in out
    assert "MHA 16/16, 64k tokens" in out and "contiguous: eff 0." in out and "zigzag: eff 0." in out
    assert bd.main(["--dry-run", "--modes", "nd", "--tokens", "64k", "--heads", "16"]) == 0
    assert "model" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ environment


NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_multicast_off_before_torch_is_imported():
    """The three variables are set by the module's first statements, before any torch import."""
    tree = ast.parse(open(SCRIPT).read())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    first_torch = next(i for i, n in enumerate(body) if isinstance(n, (ast.Import, ast.ImportFrom))
                       and any((a.name if isinstance(n, ast.Import) else n.module or "").startswith("torch")
                               for a in n.names))
    set_vars = {}
    for n in body[:first_torch]:
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", "") == "setdefault":
            k, v = (a.value for a in n.value.args)
            set_vars[k] = v
    assert set_vars == NVLS


def test_multicast_variables_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in NVLS}
    env["NVSHMEM_DISABLE_NVLS"] = "1"   # a value already there is kept
    code = ("import os, sys; sys.path.insert(0, 'benchmarks'); import bench_distributed; "
            f"print([os.environ[k] for k in {list(NVLS)!r}])")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(list(NVLS.values()))


def test_cuda_run_without_a_gpu_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bd.main(["--tokens", "64k"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ a whole CPU run


@pytest.mark.distributed
def test_cpu_gloo_run_produces_the_tables(tmp_path):
    """Two spawned gloo processes through the whole loop: ours T1 and CP (both modes and layouts, MHA
    and GQA) and torch CP with the flash backend, which torch cannot run on CPU: a reported row, not a
    crash. Ours CP must match ours T1, and torch's own sharding must equal the zigzag shards we give it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(v, None)
    out_dir, jpath = tmp_path / "out", tmp_path / "r.json"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--tokens", "1024", "--heads", "2/2,4/2", "--hdim", "64",
           "--rounds", "1", "--warmup", "0", "--peers", "flash", "--rotate", "alltoall", "--commit", "testcommit",
           "--json", str(jpath), "--out", str(out_dir)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert out.startswith("# dash_fa3 context parallelism, forward + backward: P = 2 ranks")
    assert "CPU x2 (gloo)" in out and "testcommit" in out
    for name in ("MHA 2/2, 1k tokens", "GQA 4/2, 1k tokens"):
        assert f"## {name} (batch 1, hdim 64, bf16, causal)" in out
    assert re.search(r"^## .*bar$", out, re.M) and "no verdicts" in out
    assert (out_dir / "table.md").read_text().strip() == out.strip()

    blob = json.loads(jpath.read_text())
    assert blob == json.loads((out_dir / "results.json").read_text())
    assert blob["meta"]["world_size"] == 2 and blob["meta"]["commit"] == "testcommit"
    assert len(blob["configs"]) == 2
    for rec in blob["configs"]:
        impls = rec["impls"]
        for name in ("ours T1 nd", "ours T1 det", "ours CP nd contiguous", "ours CP nd zigzag",
                     "ours CP det contiguous", "ours CP det zigzag"):
            r = impls[name]
            assert r["status"] == "ok", (name, r)
            assert len(r["samples_ms"]) == 1 and r["stats"]["median"] > 0
            assert f"| {name} | {bd.fmt_ms(r['stats']['median'])} |" in out
        for name in ("ours CP nd contiguous", "ours CP det zigzag", "ours T1 det"):
            chk = impls[name]["check"]
            for t in ("out", "dq", "dk", "dv"):   # bf16 rounding of the same fp32 math, not a different answer
                assert chk["diff"][t] <= 0.02 * chk["ref_max"][t] and chk["ref_max"][t] > 0, (name, t, chk)
        assert impls["ours T1 nd"]["check"] == {"is_reference": True}
        for name, row in rec["figures"]["rows"].items():
            if name.startswith("ours CP"):
                mode = name.split()[2]
                t1 = impls[f"ours T1 {mode}"]["stats"]["median"]
                assert row["eff_ours"] == pytest.approx(t1 / (2 * impls[name]["stats"]["median"]))
        assert "eff" in rec["model"]["contiguous/1"] and "eff" in rec["model"]["zigzag/1"]
        peer = impls["torch CP flash alltoall"]
        assert peer["status"] in ("ok", "not available", "error"), peer
        if peer["status"] != "ok":
            assert f"| torch CP flash alltoall | {peer['status']} |" in out and "- torch CP flash alltoall: " in out
        assert rec["peer_layout"].startswith("the same tokens as our zigzag layout"), rec["peer_layout"]


def test_nd_rows_through_the_head_parallel_algorithm():
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--heads", "2/2", "--nd-transports", "shared:1"])
    impls = {im.name: im for im in bd.implementations(args)}
    row = impls["ours CP nd zigzag heads shared x1"]
    assert (row.mode, row.algorithm, row.transport, row.chunks) == ("nd", "heads", "shared", 1)
    assert row.model_key == ("nd-heads", "zigzag", 1)
    assert impls["ours CP nd zigzag"].algorithm == "" and impls["ours CP nd zigzag"].model_key == ("nd", "zigzag")
    models = bd.det_models(args, bd.configs(args)[0], 2, t1_ms=100.0, t1_nd_ms=90.0)
    assert models[("nd-heads", "zigzag", 1)]["t1_ms"] == pytest.approx(90.0)
    assert models[("zigzag", 1)]["t1_ms"] == pytest.approx(100.0)
    with pytest.raises(SystemExit):
        bd.parse_args(["--device", "cpu", "--tokens", "2048", "--nd-transports", "shared"])


def test_nd_default_rows_take_the_model_of_the_default_algorithm():
    args = bd.parse_args(["--device", "cpu", "--tokens", "2048", "--heads", "4/2,4/1", "--nd-runs"])
    names = [im.name for im in bd.implementations(args)]
    assert "ours CP nd zigzag runs" in names and "ours CP nd zigzag" in names
    gqa, mqa = bd.configs(args)
    head_model = bd.model_prediction(gqa, 2, "zigzag", 90.0)
    assert bd.nd_models(args, gqa, 2, 90.0, "cuda")[("nd", "zigzag")] == head_model
    assert bd.nd_models(args, gqa, 2, 90.0, "cpu")[("nd", "zigzag")] == bd.run_plan_model(gqa, 2, "zigzag", 90.0)
    assert bd.nd_models(args, mqa, 2, 90.0, "cuda")[("nd", "zigzag")] == bd.run_plan_model(mqa, 2, "zigzag", 90.0)
    assert bd.nd_models(args, gqa, 2, 90.0, "cuda")[("nd-runs", "zigzag")] == bd.run_plan_model(gqa, 2, "zigzag", 90.0)
