"""The engine benches (bench/engine_table.py, fidelity_engine.py, fidelity_steps.py) take a
trace by path or by its name in the shared traces folder, and send its lengths only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def engine_table(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("engine_table",
                                                  ROOT / "bench" / "engine_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "named.csv").write_text("arrival_time,num_prefill_tokens,num_decode_tokens\n"
                                      "0.5,12,3\n1.5,40,7\n")
    monkeypatch.setattr(module, "TRACES", traces)
    return module


def test_a_trace_by_name_or_by_path_loses_its_arrival_times(engine_table, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    by_name = Path(engine_table.lengths_only("named.csv", str(out))).read_text()
    assert by_name == "num_prefill_tokens,num_decode_tokens\n12,3\n40,7\n"
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_text("num_prefill_tokens,num_decode_tokens,arrival_time\n5,1,0\n")
    written = engine_table.lengths_only(str(elsewhere), str(out))
    assert Path(written).read_text() == "num_prefill_tokens,num_decode_tokens\n5,1\n"
    assert elsewhere.read_text().startswith("num_prefill_tokens,num_decode_tokens,arrival")


def test_a_missing_trace_is_one_line_before_anything_is_written(engine_table, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SystemExit, match=r"^no trace 'gone\.csv': neither a file nor one of "):
        engine_table.lengths_only("gone.csv", str(out))
    assert not list(out.iterdir())
