"""examples/train_llama_deterministic.py: its data, its argument checks, and a
tiny run on the CPU reference path (the GPU test runs the real model)."""

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="the example trains a transformers 5.x Llama")

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "train_llama_deterministic.py")
TINY = ["--steps", "3", "--batch", "2", "--seqlen", "64", "--layers", "1", "--heads", "2", "--heads-kv", "1",
        "--headdim", "64", "--vocab", "128", "--prefix", "16"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_llama_deterministic", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batches_repeat_a_walk_of_the_chain_and_are_reproducible(example):
    args = example.parse_args(["--device", "cpu", "--steps", "4", "--batch", "3", "--seqlen", "100", "--prefix", "32"])
    a, b = example.make_batches(args), example.make_batches(args)
    assert len(a) == 4 and all(torch.equal(x, y) for x, y in zip(a, b))
    x = a[0]
    assert x.shape == (3, 100)
    assert torch.equal(x[:, 32:64], x[:, :32]) and torch.equal(x[:, 96:], x[:, :4])
    assert not torch.equal(a[0], a[1])  # fresh walks every step
    assert int(x.max()) < args.vocab
    succ = example.transitions(args)
    for row in x:  # every step of a walk follows the chain
        for t0, t1 in zip(row[:31].tolist(), row[1:32].tolist()):
            assert t1 in succ[t0].tolist()


@pytest.mark.parametrize("bad", [["--heads", "6", "--heads-kv", "4"], ["--prefix", "2048"], ["--steps", "0"],
                                 ["--lr", "-1"], ["--lr", "nan"]])
def test_bad_arguments_exit_with_a_message(example, bad, capsys):
    with pytest.raises(SystemExit) as e:
        example.parse_args(["--device", "cpu", *bad])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bitwise_comparison_sees_one_ulp(example):
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    assert example.bitwise_equal(a, b)
    b[1] = torch.nextafter(b[1], torch.tensor(10.0))
    assert not example.bitwise_equal(a, b)


def test_tiny_run_on_cpu(example, tmp_path):
    out = tmp_path / "run.json"
    assert example.main(["--device", "cpu", *TINY, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical"] is True
    runs = data["runs"]
    assert set(runs) == set(example.RUNS)
    for res in runs.values():
        assert len(res["losses"]) == 3 and all(0 < x < 10 for x in res["losses"])
    assert data["max_diff_first_100"] < 0.05


@pytest.mark.gpu
def test_two_deterministic_runs_are_bitwise_identical_on_gpu(example, tmp_path):
    out = tmp_path / "run.json"
    assert example.main(["--steps", "30", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical"] is True
    a = data["runs"]["dash_fa3 det #1"]["losses"]
    assert a[-1] < a[0]  # it learns
    assert data["max_diff_first_100"] < 0.05
