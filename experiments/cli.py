"""Command-line front of the Hydra apps: bad input is one line on stderr and exit code 2.

Hydra reports composition errors (an unknown key, a missing config, a wrongly typed value) on
several lines with exit code 1, after the app may have started. `preflight_or_exit` composes
every job the command line describes first (each combination of a multirun), runs the app's own
validation on it, and stops there with one line if anything is wrong.
"""
from __future__ import annotations

import difflib
import gc
import functools
import itertools
import os
import re
import sys
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from .points import CONF_DIR, ConfigError


def preflight(config_name: str, argv: list[str], validate: Callable[[DictConfig, bool], None]) -> None:
    """Compose and validate every job of this command line; raise ConfigError if any is bad.
    `validate(cfg, remote)`: remote is True when a Hydra launcher other than the basic one
    (e.g. hydra/launcher=slurm) runs the jobs elsewhere."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    multirun = any(a in ("-m", "--multirun") for a in argv)
    remote = any(a.startswith("hydra/launcher=") and a != "hydra/launcher=basic" for a in argv)
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise ConfigError(one_line(e)) from None
    if multirun:
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                   else [o.input_line] for o in parsed]
        jobs = [list(combo) for combo in itertools.product(*choices)]
    else:
        jobs = [overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            for job in jobs:
                try:
                    cfg = compose(config_name=config_name, overrides=job)
                except Exception as e:
                    raise ConfigError(one_line(e) + _nearest_key(compose(config_name=config_name), str(e))) from None
                for key in ("results_dir", "out_dir"):
                    if cfg.get(key):
                        check_output_folder(key, str(cfg[key]))
                validate(cfg, remote)
    finally:
        GlobalHydra.instance().clear()


def _nearest_key(cfg: DictConfig, message: str) -> str:
    """"; did you mean 'stage'?" for a key Hydra could not override, when one is close."""
    found = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", message)
    if not found:
        return ""
    wrong = found.group(1) or found.group(2)
    keys: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node.keys():
            keys.append(prefix + str(k))
            value = node._get_node(k)
            if isinstance(value, DictConfig) and not value._is_none():
                walk(value, f"{prefix}{k}.")
    walk(cfg, "")
    close = difflib.get_close_matches(wrong, keys, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_output_folder(key: str, value: str) -> None:
    """An output folder the command can create or write: not a file, nor under one."""
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"lies under {part}, which is a file"
                raise ConfigError(f"{key}={value} {what}: give a folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}={value}: {part} is not writable here")
            return


def exit_on_interrupt(what: str | Callable[..., str]) -> Callable:
    """Ctrl-C as one line and exit code 130: what was recorded stays, and how to go on (`what`, or
    what(*args) of the wrapped call where that depends on its arguments)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"\ninterrupted: {what(*args, **kwargs) if callable(what) else what}", file=sys.stderr)
                # Leave now: Python's shutdown would first collect every object the run built
                # (seconds after a simulation, long enough for a second Ctrl-C to break an atexit
                # callback with a traceback); frozen objects are not collected
                gc.freeze()
                sys.exit(130)
        return run
    return wrap


def preflight_or_exit(config_name: str, argv: list[str], validate: Callable[[DictConfig, bool], None]) -> None:
    """Exit 2 with one line on bad input; with ZERO_REPRO_CHECK_ONLY=1, exit 0 after the check
    (slurm/launch.sh checks a job's overrides this way before starting any rank)."""
    try:
        preflight(config_name, argv, validate)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("ZERO_REPRO_CHECK_ONLY") == "1":
        sys.exit(0)


def one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages (and their causes), folded to one line."""
    text, cause = str(error), error.__cause__ or error.__context__
    while cause is not None:
        text += "\n" + str(cause)
        cause = cause.__cause__ or cause.__context__
    text = text.split("Config search path")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    noise = ("full_key:", "object_type", "reference_type", "To append", "Set the environment", "In '",
             "invalid literal for")
    kept: list[str] = []
    for line in lines:
        if line.startswith("In '") and "Could not find" in line:
            line = line.split(": ", 1)[1]  # "In 'sweep': Could not find 'model/nope'" -> the finding
        elif line.startswith(noise) or "$VALUE" in line or "$KEY" in line:  # OmegaConf's unfilled templates
            continue
        if kept and kept[-1].startswith("Available options") and ":" not in line:
            kept[-1] += (" " if kept[-1].endswith(":") else ", ") + line
        else:
            kept.append(line)
    return "; ".join(line.rstrip(".") for line in dict.fromkeys(kept)) or type(error).__name__
