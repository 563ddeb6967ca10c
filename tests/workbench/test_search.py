"""search_tree's bounds, called directly on a jail (the tool-level behaviour is tests/tools/test_search_edit.py's).

What this proves: the time budget and the scanned-bytes budget stop a search with truncated and
the reason, rather than running on. It does not prove how long one regex line takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.paths import Jail
from bastion.safety.redact import Redactor
from bastion.safety.search import search_pattern
from bastion.workbench import search


@pytest.fixture
def jail(tmp_path: Path) -> Iterator[Jail]:
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("needle\n" * 10)
    with Jail(tmp_path) as j:
        yield j


def test_search_past_its_time_budget_stops_with_truncated(jail: Jail, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search, "SEARCH_BUDGET_S", -1.0)
    found = search.search_tree(
        jail, Redactor(), search_pattern("needle", regex=False), path=".", glob=None, max_results=100
    )
    assert found["truncated"] is True
    assert "took over" in str(found["truncated_by"])
    assert found["matches"] == []


def test_search_past_its_byte_budget_stops_with_truncated(jail: Jail, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search, "MAX_SEARCH_SCAN_BYTES", 100)
    found = search.search_tree(
        jail, Redactor(), search_pattern("needle", regex=False), path=".", glob=None, max_results=100
    )
    assert found["truncated"] is True
    assert "MiB were searched" in str(found["truncated_by"])
    assert found["files_searched"] == 1
