"""Read back what ``ol.record`` published in an executed notebook, located by source-notebook cell."""

from __future__ import annotations

from dataclasses import dataclass

from opsnn_lab.recording import RECORD_MIME

__all__ = ["INSERTED_TAGS", "RecordedFigure", "read_figures", "source_cell_indices"]

# cells papermill adds to the executed copy; they do not exist in the notebook the user wrote
INSERTED_TAGS = ("injected-parameters", "papermill-error-cell-tag")


@dataclass(frozen=True)
class RecordedFigure:
    """The last value recorded under ``name``; ``cell`` indexes the source notebook, ``times`` counts calls."""

    name: str
    value: object
    cell: int | None
    times: int = 1


def source_cell_indices(nb) -> list[int | None]:
    """For each cell of the executed notebook, its index in the source notebook (None if papermill added it)."""
    out, index = [], 0
    for cell in nb.cells:
        if any(tag in cell.get("metadata", {}).get("tags", []) for tag in INSERTED_TAGS):
            out.append(None)
        else:
            out.append(index)
            index += 1
    return out


def read_figures(nb) -> dict[str, RecordedFigure]:
    """Every ``application/vnd.opsnn.record+json`` output, in execution order; a re-recorded name keeps
    its last value (as when a cell is run again)."""
    figures: dict[str, RecordedFigure] = {}
    for cell, source_index in zip(nb.cells, source_cell_indices(nb)):
        for output in cell.get("outputs", []):
            payload = output.get("data", {}).get(RECORD_MIME)
            if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
                continue
            name = payload["name"]
            times = figures[name].times + 1 if name in figures else 1
            figures[name] = RecordedFigure(name, payload.get("value"), source_index, times)
    return figures
