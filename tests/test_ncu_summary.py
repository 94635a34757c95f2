"""benchmarks/peers/ncu_summary.py on small synthetic Nsight Compute exports."""

import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "peers"))
import ncu_summary  # noqa: E402

TENSOR = "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"


def write_raw(path, kernels):
    """kernels: [(name, {metric: value})]; the second row holds the units, as ncu writes it."""
    names = sorted({m for _, values in kernels for m in values})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Kernel Name", *names])
        w.writerow(["", "", *("ms" if n == "gpu__time_duration.sum" else "" for n in names)])
        for i, (name, values) in enumerate(kernels):
            w.writerow([str(i), name, *(values.get(n, "") for n in names)])


def write_sass(path, kernel, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_mio"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for _ in range(2):  # ncu prints a kernel's block twice; only the first counts
            w.writerow(["Kernel Name", kernel])
            w.writerow(header)
            w.writerows(rows)


def test_summary_compares_main_kernels_only(tmp_path):
    write_raw(tmp_path / "ours_h64_causal_8192.raw.csv", [
        ("bwd_preprocess_kernel", {"gpu__time_duration.sum": "0.1", TENSOR: "1"}),
        ("void dash_fa3::bwd::bwd_kernel<...>", {"gpu__time_duration.sum": "3.5", TENSOR: "49.25",
                                                 "smsp__inst_executed.sum": "683,000,000"}),
    ])
    write_raw(tmp_path / "fa3_h64_causal_8192.raw.csv", [
        ("flash::FlashAttnBwdSm90<...>", {"gpu__time_duration.sum": "2.75", TENSOR: "58.5",
                                          "smsp__inst_executed.sum": "751000000"}),
    ])
    write_sass(tmp_path / "ours_h64_causal_8192.sass.csv", "void dash_fa3::bwd::bwd_kernel<...>",
               [["0x10", "STS.128 [R8], R24", "30", "25", "5"], ["0x20", "HGMMA ...", "10", "0", "10"]])
    text = ncu_summary.summarize(tmp_path, top=1)
    assert "### hdim 64 causal 8192" in text
    assert "| duration (us) | 3.5e+03 | 2.75e+03 |" in text
    assert "| tensor pipe active (% of peak) | 49.2 | 58.5 |" in text
    assert "| instructions issued (M) | 683 | 751 |" in text
    assert "| shared-store bank conflicts (M wavefronts) | n/a | n/a |" in text
    # Top stalls: 30 of 40 samples on the STS.128, mostly barrier (25 of 40).
    assert "| STS.128 [R8], R24 | 75.0% | barrier 62.5%, mio 12.5% |" in text
    assert "HGMMA" not in text.split("ours: the 1 instructions")[1]


def test_cli_rejects_a_folder_without_exports(tmp_path, capsys):
    assert ncu_summary.main([str(tmp_path)]) == 2
    assert "no IMPL_hHDIM_MASK_SEQLEN.raw.csv" in capsys.readouterr().err


def test_forward_direction_reads_the_forward_kernels(tmp_path):
    """--direction fwd compares our fwd_kernel with FA3's FlashAttnFwdSm90 (the packed order
    kernel and any backward kernel in the same export are not the forward's main kernel)."""
    write_raw(tmp_path / "ours_h128_full_2048.raw.csv", [
        ("dash_fa3::fwd_packed_order_kernel", {"gpu__time_duration.sum": "0.01"}),
        ("void dash_fa3::fwd::fwd_kernel<...>", {"gpu__time_duration.sum": "0.8", TENSOR: "60"}),
    ])
    write_raw(tmp_path / "fa3_h128_full_2048.raw.csv", [
        ("flash::FlashAttnFwdSm90<...>", {"gpu__time_duration.sum": "0.7", TENSOR: "66"}),
    ])
    text = ncu_summary.summarize(tmp_path, direction="fwd")
    assert "| duration (us) | 800 | 700 |" in text
    assert "| tensor pipe active (% of peak) | 60 | 66 |" in text


def test_conflicts_rank_instructions_by_excess_wavefronts(tmp_path):
    write_raw(tmp_path / "ours_h192_full_8192.raw.csv", [
        ("void dash_fa3::bwd::bwd_kernel<...>", {"gpu__time_duration.sum": "6.9"}),
    ])
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", ncu_summary.EXCESS_COLUMN,
              "L1 Wavefronts Shared Ideal"]
    with open(tmp_path / "ours_h192_full_8192.sass.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void dash_fa3::bwd::bwd_kernel<...>"])
        w.writerow(header)
        w.writerows([["0x10", "STSM.16.M88.4 [R3], R8", "5", "300", "100"],
                      ["0x20", "STS.64 [R9], R10", "5", "100", "50"],
                      ["0x30", "LDS.128 R4, [R2]", "5", "0", "80"]])
    text = ncu_summary.summarize(tmp_path, conflicts=5)
    block = text.split("ours: the 5 instructions with the most excess shared wavefronts")[1]
    assert "| STSM.16.M88.4 [R3], R8 | 75.0% | 100 |" in block
    assert "| STS.64 [R9], R10 | 25.0% | 50 |" in block
    assert "LDS.128" not in block  # no excess: not listed
    assert "stall samples" not in text  # --top not asked for


def test_conflicts_say_when_the_export_lacks_the_column(tmp_path):
    write_raw(tmp_path / "fa3_h192_full_8192.raw.csv", [("flash::FlashAttnBwdSm90<...>", {})])
    write_sass(tmp_path / "fa3_h192_full_8192.sass.csv", "flash::FlashAttnBwdSm90<...>",
               [["0x10", "STS.128 [R8], R24", "30", "25", "5"]])
    assert "no column 'L1 Wavefronts Shared Excessive'" in ncu_summary.summarize(tmp_path, conflicts=3)
