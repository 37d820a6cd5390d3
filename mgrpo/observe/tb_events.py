"""TensorBoard event files written with tensorboard's own classes, without torch.

torch's `SummaryWriter` is a thin layer over tensorboard's `EventFileWriter`; importing it costs the driver
`import torch` (~136 MiB of its memory) for three kinds of record. These are those records, built as
`torch/utils/tensorboard/summary.py` builds them, so every reader of the files (EventAccumulator, the
TensorBoard tabs) sees what it saw before: scalars as `simple_value`, the Custom Scalars layout, text.
(tensorboard's plugins' own `pb` builders for text and custom scalars import TensorFlow, which is not
installed; `text_pb` of the text plugin's summary_v2 and the custom-scalar plugin's metadata are numpy only.)
"""

from __future__ import annotations

import time
from typing import Optional

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class EventWriter:
    """One event file in `log_dir` (a new file per writer, as SummaryWriter's)."""

    def __init__(self, log_dir: str, *, purge_step: Optional[int] = None, max_queue: int = 10,
                 flush_secs: int = 120):
        self._writer = EventFileWriter(log_dir, max_queue, flush_secs)
        if purge_step is not None:
            # What SummaryWriter(purge_step=...) writes (its `_get_file_writer`): an event at purge_step with a
            # file version, then a SessionLog START there. TensorBoard then hides the events a previous attempt
            # logged at steps >= purge_step in the older files of this directory.
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Event, step: Optional[int] = None) -> None:
        event.wall_time = time.time()
        if step is not None:
            event.step = int(step)
        self._writer.add_event(event)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """The old-style scalar (simple_value), as SummaryWriter.add_scalar writes it by default."""
        self._add(Event(summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Markdown for the Text tab, under `<tag>/text_summary` as SummaryWriter.add_text names it."""
        self._add(Event(summary=text_pb(tag + "/text_summary", [text])), step)  # shape [1], as torch writes it

    def add_custom_scalars(self, layout: dict) -> None:
        """The Custom Scalars tab's layout: {category: {chart title: ['Multiline', [tag regexes]]}}, the
        format SummaryWriter.add_custom_scalars takes (Multiline charts; 'Margin' ones are not used here)."""
        categories = []
        for category, charts in layout.items():
            made = []
            for title, (kind, tags) in charts.items():
                if kind != "Multiline":
                    raise ValueError(f"custom scalars chart {title!r}: only Multiline charts are written, got {kind!r}")
                made.append(layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=tags)))
            categories.append(layout_pb2.Category(title=category, chart=made))
        tensor = TensorProto(dtype="DT_STRING", string_val=[layout_pb2.Layout(category=categories).SerializeToString()],
                             tensor_shape=TensorShapeProto())
        value = Summary.Value(tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
                              metadata=custom_scalar_metadata.create_summary_metadata(), tensor=tensor)
        self._add(Event(summary=Summary(value=[value])))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
