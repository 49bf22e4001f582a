"""``JSONLinesTracker``: an Accelerate tracker that needs no service or package, one JSON object
per ``accelerator.log`` call (``{"step": ..., **values}``; the file starts empty at
``init_trackers``, or keeps its rows with ``append=True`` for a resumed run), for runs without
TensorBoard or W&B and for reading logged values back."""

from __future__ import annotations

import json
import os
from typing import Any

from accelerate.tracking import GeneralTracker


class JSONLinesTracker(GeneralTracker):
    """``Accelerator(log_with=[JSONLinesTracker(path)])``: ``init_trackers`` empties ``path``
    (unless ``append``: a resumed run adds its rows after the first run's), each
    ``accelerator.log`` appends one line (main process)."""

    name = "jsonlines"
    requires_logging_directory = False

    def __init__(self, path: str, *, append: bool = False) -> None:
        super().__init__()
        self.path, self.append = path, append

    @property
    def tracker(self) -> str:
        return self.path

    def start(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if not self.append:
            open(self.path, "w").close()

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write({"config": values})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, **values})

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
