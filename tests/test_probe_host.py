"""Host probe: live against this machine (checked with independent sources) and on captured files."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import pytest

from capture import manifest
from capture.probes import ProbeOptions
from capture.probes import host

FIXTURES = Path(__file__).parent / "fixtures" / "host"


def test_live_host_agrees_with_independent_sources() -> None:
    info = host.probe(ProbeOptions(), root=Path("/"))  # "/" itself, whatever CAPTURE_HOST_ROOT says
    assert info.hostname == socket.gethostname()
    assert info.kernel == platform.release()
    assert info.arch == platform.machine()
    assert info.cpu_count == os.cpu_count()
    assert info.cpu_count_usable == len(os.sched_getaffinity(0))
    # MemTotal and the kernel's page count both come from sysinfo's totalram.
    assert info.memory_total_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    osr = platform.freedesktop_os_release()
    assert info.os == osr.get("PRETTY_NAME")
    assert info.os_id == osr.get("ID")
    assert info.os_version_id == osr.get("VERSION_ID")
    name, version = platform.libc_ver()
    assert info.libc == f"{name} {version}"


def test_captured_debian_vm_files() -> None:
    info = host.probe(ProbeOptions(), root=FIXTURES / "debian12-epyc-vm")
    assert info.os == "Debian GNU/Linux 12 (bookworm)"
    assert info.os_id == "debian"
    assert info.os_version_id == "12"
    assert info.cpu_model == "AMD EPYC"
    assert info.memory_total_bytes == 24683584 * 1024


def test_missing_files_leave_fields_out(tmp_path: Path) -> None:
    info = host.probe(ProbeOptions(), root=tmp_path)
    table = manifest.to_toml_value(info.to_manifest())
    for key in ("os", "os_id", "os_version_id", "cpu_model", "memory_total_bytes"):
        assert key not in table
    assert table["kernel"] and table["arch"] and table["hostname"]


def test_os_release_quoting_and_fallback_file(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/os-release").write_text(
        '# comment\nNAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS \\"jammy\\""\nID=ubuntu\nVERSION_ID=\'22.04\'\n\nBROKEN LINE\n'
    )
    info = host.probe(ProbeOptions(), root=tmp_path)
    assert info.os == 'Ubuntu 22.04.4 LTS "jammy"'
    assert info.os_id == "ubuntu"
    assert info.os_version_id == "22.04"


# Shaped like /proc/cpuinfo on an Arm Neoverse V2 (Grace) core, which has no "model name".
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve sve2
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 0
"""


@pytest.mark.parametrize(
    ("text", "model"),
    [
        (ARM_CPUINFO, "Arm Neoverse V2"),
        (ARM_CPUINFO.replace("0xd4f", "0xfff"), "Arm implementer 0x41 part 0xfff"),
        ("processor\t: 0\ncpu\t\t: POWER9 (raw), altivec supported\n", "POWER9 (raw), altivec supported"),
        ("processor\t: 0\ncpu MHz\t\t: 2400\n", None),
    ],
)
def test_cpu_model_variants(text: str, model: str | None) -> None:
    assert host.parse_cpu_model(text) == model


@pytest.mark.parametrize(("text", "value"), [("MemTotal:  1024 kB\n", 1048576), ("MemFree: 1 kB\n", None), ("MemTotal: x kB\n", None)])
def test_meminfo(text: str, value: int | None) -> None:
    assert host.parse_meminfo_total_bytes(text) == value


def test_host_root_from_the_environment_feeds_the_probe_and_the_trials_device_name(tmp_path: Path, monkeypatch) -> None:
    """CAPTURE_HOST_ROOT: every host fact read from files comes from that tree, and the trial's
    CPU device name is the probe's cpu_model (one reader of /proc/cpuinfo)."""
    from capture.recorder import device_name
    from capture.trial import hostmem

    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nmodel name\t: Example CPU 9000 @ 1.00GHz\n")
    (tmp_path / "proc/meminfo").write_text("MemTotal:       2048 kB\n")
    (tmp_path / "proc/sys/kernel/hostname").write_text("identity-test-host\n")
    (tmp_path / "proc/sys/kernel/osrelease").write_text("9.9.9-example\n")
    (tmp_path / "etc/os-release").write_text('PRETTY_NAME="Example OS 1"\nID=example\nVERSION_ID="1"\n')
    monkeypatch.setenv(host.ROOT_ENV, str(tmp_path))
    info = host.probe(ProbeOptions())
    assert (info.hostname, info.kernel, info.cpu_model, info.memory_total_bytes, info.os, info.os_id) == (
        "identity-test-host", "9.9.9-example", "Example CPU 9000 @ 1.00GHz", 2048 * 1024, "Example OS 1", "example")
    assert info.arch == platform.machine() and info.cpu_count == os.cpu_count()  # not file facts
    assert device_name("cpu") == "CPU: Example CPU 9000 @ 1.00GHz"
    assert hostmem.read().total_bytes == 2048 * 1024  # no cgroup is limited below 2 MiB
    monkeypatch.delenv(host.ROOT_ENV)
    assert host.probe(ProbeOptions()) == host.probe(ProbeOptions(), root=Path("/"))


def test_empty_kernel_files_fall_back_to_uname(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/hostname").write_text("\n")
    info = host.probe(ProbeOptions(), root=tmp_path)
    assert info.hostname == socket.gethostname() and info.kernel == platform.release()
    assert host.cpu_model(tmp_path) is None and host.memory_total_bytes(tmp_path) is None
