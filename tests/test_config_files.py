"""Tests for edgetrain.config.files: the one YAML loader and from_mapping, the conversion every
config file (job, experiment, trace; fleet next) uses; errors are one line naming file, key, value."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgetrain.config import ConfigError, from_mapping, load_yaml, parse_yaml, require

pytestmark = pytest.mark.timeout(30)


@dataclass(kw_only=True, frozen=True)
class Link:
    mbit_per_s: float

    def __post_init__(self) -> None:
        require(self.mbit_per_s > 0, "mbit_per_s", self.mbit_per_s, "must be > 0")


@dataclass(kw_only=True, frozen=True)
class Board:
    name: str
    count: int = 1
    link: Link | None = None


@dataclass(kw_only=True, frozen=True)
class Fleet:
    boards: list[Board]
    events: tuple[Link, ...] = ()
    job: dict = field(default_factory=dict)
    speeds: list[float] = field(default_factory=list)


def test_nested_lists_optional_sections_and_numbers_are_converted() -> None:
    # Execute
    fleet = from_mapping(Fleet, {"boards": [{"name": "a", "link": {"mbit_per_s": 5}}, {"name": "b", "count": 2}],
                                 "events": [{"mbit_per_s": 1}], "job": {"model": "x"}, "speeds": [1, 0.5]}, "f.yaml")

    # Assert
    assert fleet == Fleet(boards=[Board(name="a", link=Link(mbit_per_s=5.0)), Board(name="b", count=2)],
                          events=(Link(mbit_per_s=1.0),), job={"model": "x"}, speeds=[1.0, 0.5])
    assert isinstance(fleet.boards[0].link.mbit_per_s, float) and isinstance(fleet.events, tuple)


@pytest.mark.parametrize(("data", "message"), [
    ({"boards": [{"name": "a", "link": {"mbit_per_s": 0}}]},
     "f.yaml: boards[0].link: mbit_per_s=0.0: must be > 0"),
    ({"boards": [{"name": "a", "count": "two"}]}, "f.yaml: boards[0].count: expected int, got str 'two'"),
    ({"boards": [{"name": "a", "colour": "red"}]},
     "f.yaml: boards[0]: unknown key 'colour' (known: name, count, link)"),
    ({"boards": [{"count": 2}]}, "f.yaml: boards[0]: missing required key 'name'"),
    ({"boards": [{"name": "a", "link": 5}]},
     "f.yaml: boards[0].link: expected a mapping (Link) or NoneType, got int 5"),
    ({"boards": "a"}, "f.yaml: boards: expected a list of mappings (Board), got str 'a'"),
    ({"boards": [], "job": [1]}, "f.yaml: job: expected mapping, got list [1]"),
    ({"boards": [], "speeds": [1, True]}, "f.yaml: speeds[1]: expected float, got bool True"),
    ({}, "f.yaml: missing required key 'boards'"),
    ([1], "f.yaml: expected a mapping, got list [1]"),
])
def test_errors_are_one_line_naming_where_the_key_path_and_the_value(data, message) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping(Fleet, data, "f.yaml")
    assert str(caught.value) == message


@pytest.mark.parametrize(("text", "start"), [
    ("a: [1,\n", "not valid YAML: "),
    ("- 1\n- 2\n", "expected a mapping at the top level, got list [1, 2]"),
    ("just words\n", "expected a mapping at the top level, got str 'just words'"),
])
def test_the_loader_names_the_file_in_one_line(tmp_path: Path, text: str, start: str) -> None:
    # Prepare
    path = tmp_path / "c.yaml"
    path.write_text(text)

    # Execute
    with pytest.raises(ConfigError) as caught:
        load_yaml(path)

    # Assert
    message = str(caught.value)
    assert message.startswith(f"{path}: {start}") and "\n" not in message, message


def test_the_loader_reads_empty_as_an_empty_mapping_and_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert load_yaml(tmp_path / "empty.yaml") == {} and parse_yaml("", "job") == {}
    with pytest.raises(ConfigError, match=r"nope\.yaml: trace file not found$"):
        load_yaml(tmp_path / "nope.yaml", what="trace file")
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read: "):
        load_yaml(tmp_path / "nope.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"bin\.yaml: cannot read: not UTF-8 text"):
        load_yaml(tmp_path / "bin.yaml")
