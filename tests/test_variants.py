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
    assert {v.name for v in sel} == {"hdim128-bf16-causal", "hdim128-bf16-full", "hdim128-bf16-local"}
    sel = variants.select("hdim64, hdim128-causal")
    assert all(v.hdim == 64 or (v.hdim == 128 and v.causal) for v in sel)
    assert len(sel) == 6 + 2
    assert {v.name for v in variants.select("hdim64-local")} == {"hdim64-bf16-local", "hdim64-fp16-local"}
    assert variants.select("hdim64-fp16-full") == (variants.Variant(64, "fp16", "full"),)


@pytest.mark.parametrize("bad", ["hdim80", "bf16-fulll", "hdim64-int8"])
def test_select_rejects_unknown_tokens(bad):
    with pytest.raises(ValueError, match="unknown token"):
        variants.select(bad)


def test_select_reads_env(monkeypatch):
    monkeypatch.setenv(variants.ENV_VAR, "hdim96-fp16")
    assert {v.name for v in variants.select()} == {"hdim96-fp16-causal", "hdim96-fp16-full", "hdim96-fp16-local"}
    monkeypatch.delenv(variants.ENV_VAR)
    assert variants.select() == variants.select(variants.DEFAULT_FILTER)


def test_mask_of_window():
    """Which kernel family runs a window; the C++ dispatch maps the same way (mask_kind_of)."""
    assert variants.mask_of_window(-1, -1) == "full"
    assert variants.mask_of_window(-1, 0) == "causal"
    for w in ((0, 0), (5, -1), (-1, 5), (5, 0), (3, 7)):
        assert variants.mask_of_window(*w) == "local"
    with pytest.raises(ValueError):
        variants.mask_of_window(-2, 0)
    assert variants.Variant(128, "bf16", "local").local and not variants.Variant(128, "bf16", "causal").local


def test_variant_name_roundtrip():
    for v in variants.ALL_VARIANTS:
        assert variants.Variant.parse(v.name) == v
    with pytest.raises(ValueError):
        variants.Variant.parse("128-bf16")


def test_checked_in_instantiations_match_generator():
    """csrc/instantiations/ holds exactly one generated file per known (direction, variant)."""
    pairs = build_config.instantiations(variants.ALL_VARIANTS)
    on_disk = {f for f in os.listdir(build_config.INSTANTIATIONS) if f.endswith(".cu")}
    assert on_disk == {build_config.instantiation_name(d, v) for d, v in pairs}
    for d, v in pairs:
        path = build_config.INSTANTIATIONS / build_config.instantiation_name(d, v)
        assert path.read_text() == build_config.instantiation_source(d, v)
    # every variant has a forward; the backward exists for BWD_HEADDIMS
    assert sum(d == "fwd" for d, _ in pairs) == len(variants.ALL_VARIANTS)
    assert {v.hdim for d, v in pairs if d == "bwd"} == set(variants.BWD_HEADDIMS)


def test_build_sources_follow_selection():
    sel = variants.select("hdim128-bf16-causal")
    table = build_config.variant_table_source(sel)
    assert table.count('"hdim128-bf16-causal"') == 2 and "hdim64" not in table  # fwd and bwd
    table = build_config.variant_table_source(variants.select("hdim256-bf16-full"))
    assert "DASH_FA3_FOR_EACH_BWD_VARIANT(X)" in table and table.count('"hdim256-bf16-full"') == 2  # fwd and bwd
    for src in build_config.COMMON_SOURCES:
        assert os.path.isfile(os.path.join(ROOT, src)), src


@pytest.mark.skipif(not _ext.available(), reason=f"extension not loaded: {_ext.ext_error()}")
def test_built_variants_are_declared():
    built = _ext.built_fwd_variants()
    assert built, "the extension declares no forward variant"
    assert set(built) <= {v.name for v in variants.ALL_VARIANTS}
    bwd = _ext.built_bwd_variants()
    assert set(bwd) == {name for name in built if variants.Variant.parse(name).has_bwd}
