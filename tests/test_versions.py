"""Which torch a board may train with: the floor admits JetPack 6.1's NVIDIA build, the
coordinator refuses only a torch below it (one line), and mixed releases are told apart."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import edgetrain
from edgetrain.versions import mixed_note, release, torch_refusal

REPO = Path(__file__).resolve().parent.parent
JETPACK_61 = "2.5.0a0+872d972e41.nv24.08"
"""The torch NVIDIA ships for JetPack 6.1 (and 6.2: 2.5.0a0+...nv24.xx) on Python 3.10."""
JETPACK_60 = "2.4.0a0+3bcc3cddb5.nv24.07"


def _torch_requirement() -> Requirement:
    text = (REPO / "pyproject.toml").read_text()
    line = re.search(r'^\s*"(torch[<>=!~ ].*?)",', text, re.M)
    assert line, "pyproject.toml names no torch requirement"
    return Requirement(line.group(1))


def test_pyprojects_torch_floor_admits_jetpack_61_and_the_releases_we_run():
    spec = _torch_requirement().specifier
    for version in (JETPACK_61, "2.5.0", "2.5.1", "2.9.1", "2.13.0+cpu", "2.14.1", "2.14.1+cu130"):
        assert spec.contains(version, prereleases=True), version
    for version in (JETPACK_60, "2.4.1", "2.1.0", "2.15.0"):
        assert not spec.contains(version, prereleases=True), version
    # the floor is the package's own constant, and it is below JetPack 6.1's build, not 2.5
    assert Version(edgetrain.TORCH_FLOOR) <= Version(JETPACK_61) < Version("2.5")
    assert f">={edgetrain.TORCH_FLOOR}" in str(spec)


def test_a_board_on_a_torch_below_the_floor_is_refused_and_one_on_a_newer_release_is_noted():
    assert torch_refusal(JETPACK_61) is None and torch_refusal("2.14.1") is None
    assert torch_refusal("") is None and torch_refusal("not-a-version") is None  # the board decides
    refusal = torch_refusal(JETPACK_60)
    assert refusal is not None and JETPACK_60 in refusal and edgetrain.TORCH_FLOOR in refusal
    assert release(JETPACK_61) == "2.5" and release("2.14.1+cu130") == "2.14"
    assert mixed_note("pi", "2.14.0", "2.14.1+cu130") is None
    note = mixed_note("orin", JETPACK_61, "2.14.1")
    assert note is not None and "orin" in note and JETPACK_61 in note


def test_the_coordinator_refuses_an_old_torch_at_registration_with_its_reason(coordinator_factory):
    from conftest import small_job

    from edgetrain import transport
    from edgetrain.errors import Refusal
    from protos import coordinator_pb2 as pb

    coordinator = coordinator_factory(small_job())
    stub = coordinator.stub("old-board")
    request = pb.RegisterRequest(device=pb.DeviceInfo(name="old-board"), protocol_version=edgetrain.PROTOCOL_VERSION,
                                 versions=pb.SoftwareVersions(torch=JETPACK_60))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Register(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert transport.error_reason(refused.value) == Refusal.SOFTWARE_UNSUPPORTED
    assert JETPACK_60 in refused.value.details()
    # the same board on JetPack 6.1's torch joins
    request.versions.torch = JETPACK_61
    assert stub.Register(request, timeout=30).device_id
    coordinator.stop.set()
