"""The variant list against what the build declares and generates (CPU)."""

import os
import sys

import pytest

from dash_fa3 import _ext, variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_config  # noqa: E402


def test_select_patterns():
    assert variants.select("all") == variants.ALL_VARIANTS
    sel = variants.select("hdim128-bf16")
    assert {v.name for v in sel} == {"hdim128-bf16-causal", "hdim128-bf16-full"}
    sel = variants.select("hdim64, hdim128-causal")
    assert all(v.hdim == 64 or (v.hdim == 128 and v.causal) for v in sel)
    assert len(sel) == 4 + 2
    assert variants.select("hdim64-fp16-full") == (variants.Variant(64, "fp16", "full"),)


@pytest.mark.parametrize("bad", ["hdim80", "bf16-fulll", "hdim64-int8"])
def test_select_rejects_unknown_tokens(bad):
    with pytest.raises(ValueError, match="unknown token"):
        variants.select(bad)


def test_select_reads_env(monkeypatch):
    monkeypatch.setenv(variants.ENV_VAR, "hdim96-fp16")
    assert {v.name for v in variants.select()} == {"hdim96-fp16-causal", "hdim96-fp16-full"}
    monkeypatch.delenv(variants.ENV_VAR)
    assert variants.select() == variants.select(variants.DEFAULT_FILTER)


def test_variant_name_roundtrip():
    for v in variants.ALL_VARIANTS:
        assert variants.Variant.parse(v.name) == v
    with pytest.raises(ValueError):
        variants.Variant.parse("128-bf16")


def test_checked_in_instantiations_match_generator():
    """csrc/instantiations/ holds exactly one generated file per known variant."""
    on_disk = {f for f in os.listdir(build_config.INSTANTIATIONS) if f.endswith(".cu")}
    expected = {build_config.fwd_instantiation_name(v) for v in variants.ALL_VARIANTS}
    assert on_disk == expected
    for v in variants.ALL_VARIANTS:
        path = build_config.INSTANTIATIONS / build_config.fwd_instantiation_name(v)
        assert path.read_text() == build_config.fwd_instantiation_source(v)


def test_build_sources_follow_selection():
    sel = variants.select("hdim128-bf16-causal")
    table = build_config.variant_table_source(sel)
    assert '"hdim128-bf16-causal"' in table and "hdim64" not in table
    for src in build_config.COMMON_SOURCES:
        assert os.path.isfile(os.path.join(ROOT, src)), src


@pytest.mark.skipif(not _ext.available(), reason=f"extension not loaded: {_ext.ext_error()}")
def test_built_variants_are_declared():
    built = _ext.built_fwd_variants()
    assert built, "the extension declares no forward variant"
    assert set(built) <= {v.name for v in variants.ALL_VARIANTS}
