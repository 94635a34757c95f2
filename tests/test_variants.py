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


def test_value_head_dim_variants():
    """MLA's (192, v 128) is its own token: hdim192 selects the equal dims only, and
    variant_of names the supported pairs for any other."""
    mla = variants.select("hdim192v128-bf16-causal")
    assert mla == (variants.Variant(192, "bf16", "causal", 128),)
    assert mla[0].name == "hdim192v128-bf16-causal" and mla[0].hdim_v == 128
    assert all(v.hdim_v == 192 for v in variants.select("hdim192"))
    assert variants.Variant(128, "bf16", "full").hdim_v == 128
    variants.check_head_dims(192, 128)
    variants.check_head_dims(64, 64)
    with pytest.raises(ValueError, match="q/k 128 with v 64 is not supported; supported: 64, 96, 128, 192, 256, "
                                         "q/k 192 with v 128"):
        variants.check_head_dims(128, 64)
    with pytest.raises(ValueError, match="head dim 80 is not"):
        variants.check_head_dims(80, 80)
    with pytest.raises(ValueError):
        variants.Variant.parse("hdim192x128-bf16-full")
    assert build_config.instantiation_name("bwd", mla[0], "packed") == "bwd_hdim192v128_bf16_causal_packed.cu"
    assert "run_bwd<192, 128, dash_fa3::DType::kBF16" in build_config.instantiation_source("bwd", mla[0])


def test_checked_in_instantiations_match_generator():
    """csrc/instantiations/ holds exactly one generated file per known (direction, variant, layout, softcap)."""
    insts = build_config.instantiations(variants.ALL_VARIANTS)
    on_disk = {f for f in os.listdir(build_config.INSTANTIATIONS) if f.endswith(".cu")}
    assert on_disk == {build_config.instantiation_name(*inst) for inst in insts}
    assert len(on_disk) == len(insts)
    for d, v, layout, softcap in insts:
        text = (build_config.INSTANTIATIONS / build_config.instantiation_name(d, v, layout, softcap)).read_text()
        assert text == build_config.instantiation_source(d, v, layout, softcap)
        packed = "true" if layout == "packed" else "false"
        assert f"/*kPacked=*/{packed}, /*kSoftcap=*/{'true' if softcap else 'false'}>" in text
    # every variant has a forward in each family; the backward exists for BWD_HEADDIMS
    for layout in variants.LAYOUTS:
        for softcap in variants.SOFTCAP_AXIS:
            family = [(d, v) for d, v, lay, cap in insts if (lay, cap) == (layout, softcap)]
            assert sum(d == "fwd" for d, _ in family) == len(variants.ALL_VARIANTS)
            assert {v.hdim for d, v in family if d == "bwd"} == set(variants.BWD_HEADDIMS)


def test_build_sources_follow_selection():
    sel = variants.select("hdim128-bf16-causal")
    table = build_config.variant_table_source(sel)
    # fwd and bwd, dense and packed, plain scores
    assert table.count('"hdim128-bf16-causal"') == 4 and "hdim64" not in table
    assert 'X(128, 128, kBF16, kCausal, true, false, "hdim128-bf16-causal")' in table and ", true, \"" not in table
    table = build_config.variant_table_source(variants.select("hdim256-bf16-full"))
    assert "DASH_FA3_FOR_EACH_BWD_KERNEL(X)" in table and table.count('"hdim256-bf16-full"') == 4
    # softcap kernels too: each entry twice
    table = build_config.variant_table_source(sel, variants.LAYOUTS, (False, True))
    assert table.count('"hdim128-bf16-causal"') == 8
    assert 'X(128, 128, kBF16, kCausal, false, true, "hdim128-bf16-causal")' in table
    table = build_config.variant_table_source(sel, ("dense",))
    assert table.count('"hdim128-bf16-causal"') == 2 and "true" not in table
    only = build_config.variant_table_source(sel, ("packed",), (True,))
    assert only.count('kCausal, true, true, "hdim128-bf16-causal"') == 2
    # A build without variants still declares both (empty) tables.
    empty = build_config.variant_table_source(())
    for d in build_config.DIRECTIONS:
        assert f"#define {build_config.table_macro(d)}(X) \\\n\n" in empty
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
    monkeypatch.delenv(variants.SOFTCAP_ENV, raising=False)
    sources = build_config.prepare(variants.select("hdim128-bf16-causal"))
    assert [s for s in sources if "instantiations" in s] == [
        "csrc/instantiations/fwd_hdim128_bf16_causal.cu", "csrc/instantiations/bwd_hdim128_bf16_causal.cu"]
    monkeypatch.setenv(variants.SOFTCAP_ENV, "1")
    sources = build_config.prepare(variants.select("hdim128-bf16-causal"))
    assert [s for s in sources if "instantiations" in s] == [
        "csrc/instantiations/fwd_hdim128_bf16_causal.cu", "csrc/instantiations/bwd_hdim128_bf16_causal.cu",
        "csrc/instantiations/fwd_hdim128_bf16_causal_softcap.cu",
        "csrc/instantiations/bwd_hdim128_bf16_causal_softcap.cu"]
    assert "X(128, 128, kBF16, kCausal, false, true" in (tmp_path / "variant_table.h").read_text()


def test_softcap_axis_select(monkeypatch):
    assert variants.select_softcap("0") == (False,) and variants.select_softcap("") == (False,)
    assert variants.select_softcap(" 1 ") == (False, True)
    for bad in ("2", "yes", "true", "-1"):
        with pytest.raises(ValueError, match=variants.SOFTCAP_ENV):
            variants.select_softcap(bad)
    monkeypatch.delenv(variants.SOFTCAP_ENV, raising=False)
    assert variants.select_softcap() == (False,)
    monkeypatch.setenv(variants.SOFTCAP_ENV, "1")
    assert variants.select_softcap() == (False, True)


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
    for layout_packed in (False, True):
        softcap = _ext.built_variants("fwd", layout_packed, True)
        assert set(softcap) <= set(_ext.built_variants("fwd", layout_packed))
        assert set(_ext.built_variants("bwd", layout_packed, True)) == {
            n for n in softcap if variants.Variant.parse(n).has_bwd}
