"""JsonlSink.truncate_after: a resumed run drops the records a killed run logged past its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from sslkit.hooks.logging import JsonlSink


def test_truncate_after_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path: Path) -> None:
    sink = JsonlSink(str(tmp_path))
    for step in (1, 2, 3, 4, 5):
        sink.write({"step": step, "loss": float(step)})
    with open(sink.path, "a", encoding="utf-8") as f:
        f.write('{"step": 6, "lo')  # the kill came in the middle of a write
    assert sink.truncate_after(3) == 3
    records = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    sink.write({"step": 4, "loss": 0.5})
    assert [json.loads(line)["step"] for line in Path(sink.path).read_text().splitlines()] == [1, 2, 3, 4]
    assert sink.truncate_after(10) == 0


def test_truncate_after_without_a_file_does_nothing(tmp_path: Path) -> None:
    assert JsonlSink(str(tmp_path)).truncate_after(5) == 0
    assert not (tmp_path / "metrics.jsonl").exists()
