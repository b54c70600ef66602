"""The tour's folder (``obs demo`` with no settings): ``./obs_demo/``, made afresh on each run, the settings it runs
with and the training script it runs from.  A folder is replaced only when it is a folder of this user that holds
the demo's marker."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from obs._core import safe_files
from obs._core.errors import ObsError
from obs._core.json_files import read_json

__all__ = ["DEMO_FOLDER", "MARKER", "SCRIPT", "DemoFolderError", "Tour", "load_script", "prepare_folder"]

#: The folder the tour (``obs demo`` with no settings) writes, in the current folder; replaced on each run.
DEMO_FOLDER = "obs_demo"
#: The file that makes a folder the demo's own: a folder without it is never removed.
MARKER = ".obs_demo.json"
_MARKER_DATA = {"written_by": "obs demo", "schema_version": 1}
#: The demo's training script in the tour's folder: a copy of obs/cli/_demo_train.py, which the demo runs.
SCRIPT = "train.py"
_SCRIPT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_demo_train.py")


class DemoFolderError(ObsError, ValueError):
    """``./obs_demo`` exists but is not a folder the demo made: it is left alone (exit 2)."""


def _is_demo_folder(path: str) -> str | None:
    """None when ``path`` is a folder of this user holding the demo's marker; else why it is not."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}, not to this user"
    try:
        data = read_json(os.path.join(path, MARKER), what="the demo's marker", limit=4096)
    except FileNotFoundError:
        return f"it holds no {MARKER}"
    except (OSError, ValueError):
        return f"its {MARKER} is not the demo's"
    if data.get("written_by") != _MARKER_DATA["written_by"]:
        return f"its {MARKER} is not the demo's"
    return None


def prepare_folder(path: str = DEMO_FOLDER) -> str:
    """Make ``path`` an empty folder (0700) holding only the demo's marker; returns its absolute path.

    A previous demo folder (marked, a folder of this user) is removed first, without following any
    symlink in it; anything else at ``path`` raises :class:`DemoFolderError` and is left as it is.
    """
    if os.path.lexists(path):
        why = _is_demo_folder(path)
        if why is not None:
            shown = path if os.path.isabs(path) else os.path.join(os.curdir, path)
            raise DemoFolderError(f"{shown} exists and is not a folder obs demo made ({why}); obs demo writes "
                                  f"into ./{DEMO_FOLDER}/ and replaces it on each run: move it away, or run obs demo "
                                  "in another folder")
        shutil.rmtree(path)  # fd-based on Linux: symlinks inside are removed, never followed
    os.mkdir(path, safe_files.DIR_MODE)
    folder = os.path.abspath(path)
    safe_files.write_new(os.path.join(folder, MARKER), (json.dumps(_MARKER_DATA) + "\n").encode(), folder_ready=True)
    return folder


@dataclass(frozen=True)
class Tour:
    """Where the tour writes (absolute paths under ``folder``) and the settings it runs with."""

    folder: str

    def at(self, *names: str) -> str:
        return os.path.join(self.folder, *names)

    @property
    def config(self) -> str:
        """The env config of the whole run: RDR, profiler, graphs."""
        return self.at("obs_config.json")

    @property
    def script(self) -> str:
        """The training script the tour runs: its fault is raised there, in the user's folder."""
        return self.at(SCRIPT)

    @property
    def dump_config(self) -> str:
        """The same plus the data dump, in force for the last step."""
        return self.at("obs_config_with_dump.json")

    def sections(self) -> dict[str, Any]:
        return {"rdr": {"enable": True, "path": self.at("rdr")},
                "profiler": {"enable": True, "options": "training_trace:task_trace", "output": self.at("profile")},
                "graphs": {"save_graphs": 2, "save_graphs_path": self.at("graphs")}}

    def start(self) -> None:
        """Write the training script and the env config, and turn everything on (GRAPH_MODE: ``obs.compile``
        compiles, its graphs are saved)."""
        import obs

        with open(_SCRIPT_SOURCE, "rb") as f:
            safe_files.write_new(self.script, f.read(), folder_ready=True)
        self._write(self.config, self.sections())
        obs.set_context(mode=obs.GRAPH_MODE, print_file_path=self.at("print.pb"), env_config_path=self.config)

    def start_dump(self, iteration: int) -> None:
        """Add the data dump (statistics of every op of ``iteration``) for the last step.

        Only then: the dump watches ops through a dispatch mode, and torch.compile runs a model eagerly
        while one is active, so from the first step on there would be no compiled graph to save.
        """
        import obs

        dump = {"common_dump_settings": {"dump_mode": 0, "path": self.at("dump"), "net_name": "Demo",
                                         "iteration": str(iteration), "saved_data": "statistic", "input_output": 0,
                                         "kernels": [], "support_device": [0]}}
        self._write(self.dump_config, {**self.sections(), "dump": dump})
        obs.set_context(env_config_path=self.dump_config)

    @staticmethod
    def _write(path: str, sections: dict[str, Any]) -> None:
        safe_files.write_new(path, (json.dumps(sections, indent=2) + "\n").encode(), folder_ready=True)


def load_script(tour: Tour | None) -> ModuleType:
    """The demo's training script: the tour's copy, or (with settings, which write only what they ask for) obs's own."""
    path = tour.script if tour is not None else _SCRIPT_SOURCE
    spec = importlib.util.spec_from_file_location("obs_demo_train", path)
    if spec is None or spec.loader is None:
        raise ObsError(f"obs demo: cannot load its training script {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
