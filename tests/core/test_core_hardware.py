"""CPU capability detection: the reading, and the simulation the precision decisions are tested with."""
from __future__ import annotations

from msn_core import hardware
from msn_core.hardware import cpu_info

AVX2_EPYC = "fpu sse sse2 avx avx2 fma"
ZEN4 = AVX2_EPYC + " avx512f avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " amx_tile amx_bf16 amx_int8"


def test_flags_decide_bf16_and_int8():
    assert not cpu_info(AVX2_EPYC).bf16_native and not cpu_info(AVX2_EPYC).int8_native
    assert cpu_info(ZEN4).bf16_native and cpu_info(ZEN4).int8_native and not cpu_info(ZEN4).amx
    assert cpu_info(SAPPHIRE_RAPIDS).amx and cpu_info(SAPPHIRE_RAPIDS).bf16_native
    assert cpu_info("avx2 avx_vnni").int8_native and not cpu_info("avx2 avx_vnni").bf16_native


def test_environment_variable_simulates_another_cpu(monkeypatch):
    monkeypatch.setenv(hardware.FLAGS_ENV, AVX2_EPYC)
    info = cpu_info()
    assert not info.bf16_native and "simulated" in info.model
    assert info.describe()["cpu_flags"] == ["avx2", "fma"]


def test_reads_proc_cpuinfo(tmp_path, monkeypatch):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: avx2 amx_bf16 amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: avx2 amx_bf16 amx_tile\n")
    monkeypatch.setattr(hardware, "CPUINFO", fake)
    monkeypatch.delenv(hardware.FLAGS_ENV, raising=False)
    info = cpu_info()
    assert info.model == "Test CPU 9000" and info.bf16_native and info.amx


def test_no_cpuinfo_means_the_portable_path(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "CPUINFO", tmp_path / "missing")
    monkeypatch.delenv(hardware.FLAGS_ENV, raising=False)
    info = cpu_info()
    assert info.flags == frozenset() and not info.bf16_native and not info.int8_native
