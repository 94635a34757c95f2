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
    """csrc/instantiations/ holds exactly one generated file per known (direction, variant, layout)."""
    triples = build_config.instantiations(variants.ALL_VARIANTS)
    on_disk = {f for f in os.listdir(build_config.INSTANTIATIONS) if f.endswith(".cu")}
    assert on_disk == {build_config.instantiation_name(d, v, layout) for d, v, layout in triples}
    for d, v, layout in triples:
        path = build_config.INSTANTIATIONS / build_config.instantiation_name(d, v, layout)
        assert path.read_text() == build_config.instantiation_source(d, v, layout)
        assert f"/*kPacked=*/{'true' if layout == 'packed' else 'false'}>" in path.read_text()
    # every variant has a forward in each layout; the backward exists for BWD_HEADDIMS
    for layout in variants.LAYOUTS:
        assert sum(d == "fwd" and lay == layout for d, _, lay in triples) == len(variants.ALL_VARIANTS)
        assert {v.hdim for d, v, lay in triples if d == "bwd" and lay == layout} == set(variants.BWD_HEADDIMS)


def test_build_sources_follow_selection():
    sel = variants.select("hdim128-bf16-causal")
    table = build_config.variant_table_source(sel)
    # fwd and bwd, dense and packed
    assert table.count('"hdim128-bf16-causal"') == 4 and "hdim64" not in table
    table = build_config.variant_table_source(variants.select("hdim256-bf16-full"))
    assert "DASH_FA3_FOR_EACH_BWD_VARIANT(X)" in table and table.count('"hdim256-bf16-full"') == 4
    # A dense-only build: the packed tables are declared, and empty.
    table = build_config.variant_table_source(sel, ("dense",))
    assert table.count('"hdim128-bf16-causal"') == 2
    for d in build_config.DIRECTIONS:
        macro = build_config.table_macro(d, "packed")
        assert f"#define {macro}(X) \\\n\n" in table, macro
    for src in build_config.COMMON_SOURCES:
        assert os.path.isfile(os.path.join(ROOT, src)), src


def test_layouts_select(monkeypatch, tmp_path):
    assert variants.select_layouts("packed") == ("packed",)
    assert variants.select_layouts(" packed , dense") == ("dense", "packed")
    for bad in ("", "ragged", "dense,ragged", ","):
        with pytest.raises(ValueError, match=variants.LAYOUT_ENV):
            variants.select_layouts(bad)
    monkeypatch.delenv(variants.LAYOUT_ENV, raising=False)
    assert variants.select_layouts() == variants.LAYOUTS
    monkeypatch.setenv(variants.LAYOUT_ENV, "dense")
    assert variants.select_layouts() == ("dense",)
    monkeypatch.setattr(build_config, "GENERATED", tmp_path)  # leave the checkout's build/generated alone
    sources = build_config.prepare(variants.select("hdim128-bf16-causal"))
    assert [s for s in sources if "instantiations" in s] == [
        "csrc/instantiations/fwd_hdim128_bf16_causal.cu", "csrc/instantiations/bwd_hdim128_bf16_causal.cu"]


@pytest.mark.skipif(not _ext.available(), reason=f"extension not loaded: {_ext.ext_error()}")
def test_built_variants_are_declared():
    built = _ext.built_variants("fwd")
    assert built, "the extension declares no forward variant"
    assert set(built) <= {v.name for v in variants.ALL_VARIANTS}
    bwd = _ext.built_variants("bwd")
    assert set(bwd) == {name for name in built if variants.Variant.parse(name).has_bwd}
    packed = _ext.built_variants("fwd", packed=True)
    assert set(packed) <= {v.name for v in variants.ALL_VARIANTS}
    assert set(_ext.built_variants("bwd", packed=True)) == {n for n in packed if variants.Variant.parse(n).has_bwd}
