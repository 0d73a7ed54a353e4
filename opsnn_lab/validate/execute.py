"""Execute one notebook through papermill and say which source cell broke, with its traceback."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from opsnn_lab.validate.figures import source_cell_indices
from opsnn_lab.validate.parameters import declared_language

__all__ = ["CellError", "Execution", "execute_notebook", "kernel_manager_class", "strip_ansi"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def kernel_manager_class():
    """The kernel manager notebooks run under: IPC sockets where the OS has them, TCP elsewhere.

    A kernel on TCP without CurveZMQ keys logs "Kernel is running over TCP without encryption" to the
    terminal for every notebook; over IPC (Unix domain sockets, in a private temporary directory with a
    short path) nothing is exposed and nothing is logged.
    """
    from jupyter_client import AsyncKernelManager

    if os.name == "nt":
        return AsyncKernelManager
    global _IPCKernelManager
    if _IPCKernelManager is None:
        from traitlets import default

        class IPCKernelManager(AsyncKernelManager):
            @default("transport")
            def _transport_default(self) -> str:
                return "ipc"

            @default("ip")
            def _ip_default(self) -> str:
                # sockets are "<ip>-<port>"; a Unix socket path must stay under ~100 bytes
                return os.path.join(tempfile.mkdtemp(prefix="opsnn-kernel-"), "k")

            def cleanup_ipc_files(self) -> None:
                super().cleanup_ipc_files()
                if self.transport == "ipc" and os.path.basename(os.path.dirname(self.ip)).startswith("opsnn-kernel-"):
                    shutil.rmtree(os.path.dirname(self.ip), ignore_errors=True)

        _IPCKernelManager = IPCKernelManager
    return _IPCKernelManager


_IPCKernelManager = None


@dataclass(frozen=True)
class CellError:
    """Why execution stopped. ``cell`` indexes the source notebook (None: before any cell ran)."""

    cell: int | None
    execution_count: int | None
    ename: str
    evalue: str
    traceback: str = ""
    source: str = ""

    def summary(self) -> str:
        if self.cell is None:
            return f"execution failed: {self.ename}: {self.evalue}".rstrip(": ")
        return f"{self.where()} raised {self.ename}: {self.evalue}".rstrip(": ")

    def where(self) -> str:
        if self.cell is None:
            return "the notebook"
        count = f" (In [{self.execution_count}])" if self.execution_count is not None else ""
        return f"cell {self.cell}{count}"

    def stopped(self) -> str:
        if self.cell is None:
            return f"execution failed: {self.ename}"
        return f"execution stopped at {self.where()}"

    def describe(self) -> str:
        """Summary, the failing cell's source, and the traceback: what a CI log should show."""
        parts = [self.summary()]
        if self.source:
            parts.append("cell source:\n" + _indent(self.source))
        if self.traceback:
            parts.append("traceback:\n" + _indent(self.traceback))
        return "\n".join(parts)


@dataclass
class Execution:
    notebook: Path
    nb: object  # the executed nbformat.NotebookNode (partial if a cell raised)
    parameters: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: CellError | None = None
    output: Path | None = None  # where the executed copy was kept, if the caller asked for it


def execute_notebook(notebook, output_path, parameters: dict | None = None, *, kernel_name: str | None = None,
                     timeout: float | None = None, cwd=None) -> Execution:
    """Run ``notebook`` with papermill into ``output_path``; a raising cell becomes ``Execution.error``."""
    import papermill

    # absolute: papermill saves after every cell from inside ``cwd``, where a relative path means another file
    notebook, output_path = Path(notebook).resolve(), Path(output_path).resolve()
    source = nbformat.read(notebook, as_version=4)
    kernel = kernel_name or source.metadata.get("kernelspec", {}).get("name") or "python3"
    # papermill reads the language from the metadata; a notebook written by a script may have none
    language = None if declared_language(source) else "python"
    start = time.perf_counter()
    error = None
    try:
        with _quiet("papermill"):
            nb = papermill.execute_notebook(
                str(notebook), str(output_path), parameters=dict(parameters or {}), kernel_name=kernel,
                language=language, progress_bar=False, log_output=False, cwd=str(cwd or notebook.parent),
                execution_timeout=timeout, kernel_manager_class=kernel_manager_class())
    except papermill.PapermillExecutionError as err:
        nb = _read_partial(output_path, source)
        error = _error_from_outputs(nb) or CellError(None, err.exec_count, err.ename, err.evalue,
                                                     strip_ansi("\n".join(err.traceback)), err.source)
    except Exception as err:  # noqa: BLE001 - timeouts, dead or missing kernels: report, do not crash
        nb = _read_partial(output_path, source)
        message = strip_ansi(str(err)).strip().splitlines()
        interrupted = _error_from_outputs(nb)  # a timeout interrupts the kernel: that cell shows an error
        if interrupted is not None:
            error = CellError(interrupted.cell, interrupted.execution_count, type(err).__name__,
                              message[0] if message else "", interrupted.traceback, interrupted.source)
        else:
            cell, count, src = _last_started_cell(nb)
            error = CellError(cell, count, type(err).__name__, " ".join(message), "", src)
    return Execution(notebook, nb, dict(parameters or {}), time.perf_counter() - start, error)


def _read_partial(output_path: Path, source):
    try:
        return nbformat.read(output_path, as_version=4)
    except (OSError, ValueError):  # the kernel never started: nothing was written
        return source


def _error_from_outputs(nb) -> CellError | None:
    for cell, index in zip(nb.cells, source_cell_indices(nb)):
        for output in cell.get("outputs", []):
            if output.get("output_type") != "error":
                continue
            if output.get("ename") == "SystemExit" and output.get("evalue") in ("", "0"):
                continue  # sys.exit(0) ends a notebook on purpose
            tb = strip_ansi("\n".join(output.get("traceback", [])))
            return CellError(index, cell.get("execution_count"), output.get("ename", "Error"),
                             output.get("evalue", ""), tb, cell.source)
    return None


def _last_started_cell(nb):
    started = [(index, cell) for cell, index in zip(nb.cells, source_cell_indices(nb))
               if cell.cell_type == "code" and cell.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return None, None, ""
    index, cell = started[-1]
    return index, cell.get("execution_count"), cell.source


@contextmanager
def _quiet(name: str):
    """papermill logs a warning per run for things we already check; keep CI logs to our own report."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
