"""The configuration file: shipped files are valid, bad files give one clear error each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config import ConfigError
from kimi_supervisor.configfile import load_config, parse_config
from kimi_supervisor.model import Mode

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = """
[vllm]
command = ["/opt/vllm/bin/vllm", "serve", "m"]
[modes.production]
args = []
[modes.profile]
args = ["--profiler-config", '{"profiler": "torch"}']
"""


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(text, "test.toml")
    return str(e.value).splitlines()


def test_the_shipped_host_config_is_valid_and_has_eight_gpus_with_the_profiler_json() -> None:
    config = load_config(ROOT / "config" / "kimi-supervisor.toml")
    assert config.gpus.managed == list(range(8))
    assert "--tensor-parallel-size" in config.vllm.command
    assert config.vllm.command[config.vllm.command.index("--tensor-parallel-size") + 1] == "8"
    profile = config.launch_argv(Mode.PROFILE)
    pc = profile[profile.index("--profiler-config") + 1]
    # gzip and the CUDA time table off: the flush of a capture stalls serving less
    assert json.loads(pc) == {
        "profiler": "torch", "torch_profiler_dir": "/var/lib/kimi-supervisor/traces",
        "torch_profiler_use_gzip": False, "torch_profiler_dump_cuda_time_total": False,
    }  # fmt: skip
    assert "--profiler-config" not in config.launch_argv(Mode.PRODUCTION)


def test_the_shipped_sandbox_config_is_valid(tmp_path: Path) -> None:
    # The sandbox fills in its own directory where the template says {sandbox}.
    text = (ROOT / "config" / "sandbox.toml").read_text().replace("{sandbox}", str(tmp_path))
    config = parse_config(text, "sandbox.toml")
    assert config.gpus.backend == "sim"
    assert config.systemd.scope == "user"


def test_an_unknown_key_is_one_error_naming_file_key_and_reason() -> None:
    errs = errors_of(MINIMAL + "[teardown]\nterm_grace = 3\n")
    assert errs == [
        "test.toml: teardown.term_grace: unknown key (check its spelling; "
        "`kimi-supervisor check-config` prints every key)"
    ]


def test_a_wrong_type_is_one_error_naming_the_key() -> None:
    errs = errors_of(
        MINIMAL.replace(
            'command = ["/opt/vllm/bin/vllm", "serve", "m"]', 'command = "vllm serve m"'
        )
    )
    assert len(errs) == 1
    assert errs[0].startswith("test.toml: vllm.command: ")
    assert "list" in errs[0]


def test_a_missing_mode_is_one_error_naming_the_mode() -> None:
    text = MINIMAL.replace(
        '[modes.profile]\nargs = ["--profiler-config", \'{"profiler": "torch"}\']\n', ""
    )
    assert errors_of(text) == ["test.toml: modes.profile: required key is missing"]


def test_a_negative_timeout_is_one_error_naming_the_key() -> None:
    errs = errors_of(MINIMAL + "[teardown]\nterm_grace_s = -1\n")
    assert errs == ["test.toml: teardown.term_grace_s: Input should be greater than 0"]


def test_invalid_toml_says_where() -> None:
    errs = errors_of("[vllm\n")
    assert len(errs) == 1 and errs[0].startswith("test.toml: not valid TOML: ")


def test_a_missing_file_says_so_and_how_to_pass_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no such file \(pass --config PATH\)"):
        load_config(tmp_path / "nope.toml")


def test_host_and_port_come_from_one_place() -> None:
    errs = errors_of(MINIMAL.replace('"serve", "m"]', '"serve", "m", "--port", "9"]'))
    assert errs == ["test.toml: vllm.command: remove --port from command: it is set from vllm.port"]


def test_mode_arguments_follow_the_command_byte_for_byte() -> None:
    config = parse_config(MINIMAL)
    assert config.launch_argv(Mode.PROFILE) == [
        "/opt/vllm/bin/vllm",
        "serve",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--profiler-config",
        '{"profiler": "torch"}',
    ]


def runnable(tmp_path: Path) -> str:
    """MINIMAL on a host that has what it names: an executable vLLM and the group (root's)."""
    binary = tmp_path / "vllm"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return MINIMAL.replace("/opt/vllm/bin/vllm", str(binary)) + '[control]\ngroup = "root"\n'


def check_config(src: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor.cli.admin", "check-config", *more, str(src)],
        capture_output=True,
        text=True,
    )


def test_check_config_prints_an_effective_config_that_loads_again(tmp_path: Path) -> None:
    src = tmp_path / "c.toml"
    src.write_text(runnable(tmp_path))
    r = check_config(src)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "term_grace_s = 30.0" in r.stdout  # defaults are shown
    again = parse_config(r.stdout)  # the host checks are comments: it is still a config
    assert again == parse_config(runnable(tmp_path))
    assert "# ok   vllm executable:" in r.stdout and "# ok   control group: root exists" in r.stdout
    assert "# Not checked here: the GPUs" in r.stdout


def test_check_config_fails_for_what_the_config_names_and_this_host_lacks(tmp_path: Path) -> None:
    src = tmp_path / "c.toml"
    src.write_text(
        runnable(tmp_path).replace('group = "root"', 'group = "no-such-group-kimi"')
        + f'[gpus]\nbackend = "sim"\nsim_dir = "{tmp_path / "no-gpus"}"\n'
        + f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    r = check_config(src)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "# FAIL control group: control.group 'no-such-group-kimi' does not exist" in r.stdout
    assert f"# FAIL simulated GPUs: gpus.sim_dir {tmp_path / 'no-gpus'} does not exist" in r.stdout
    # What the daemon makes itself at its start is no failure.
    assert (
        f"# ok   state directory: state.dir {tmp_path / 'state'} is made when the daemon"
        in r.stdout
    )
    assert len(r.stderr.splitlines()) == 2, r.stderr  # one line per failed check
    # --startable fails for the group (no socket for kimi-mode), not for the missing sim_dir.
    assert check_config(src, "--startable").returncode == 1
    src.write_text(src.read_text().replace('group = "no-such-group-kimi"', 'group = "root"'))
    assert check_config(src).returncode == 1 and check_config(src, "--startable").returncode == 0
    alone = check_config(src, "--no-host-checks")  # the file alone: valid
    assert alone.returncode == 0 and "# What this host has" not in alone.stdout


def test_check_config_exits_2_with_the_error_on_stderr(tmp_path: Path) -> None:
    src = tmp_path / "c.toml"
    src.write_text(MINIMAL + '[gpus]\nbackend = "cuda"\n')
    r = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor.cli.admin", "check-config", str(src)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert f"{src}: gpus.backend: Input should be 'nvml' or 'sim'" in r.stderr
    assert r.stdout == ""


def test_the_sim_backend_without_its_directory_is_refused() -> None:
    errs = errors_of(MINIMAL + '[gpus]\nbackend = "sim"\n')
    assert errs == [
        'test.toml: gpus: backend "sim" needs sim_dir, the simulated GPU host\'s directory'
    ]


def test_json_round_trip_of_the_profile_argument_keeps_quotes_and_spaces() -> None:
    config = load_config(ROOT / "config" / "kimi-supervisor.toml")
    arg = config.modes.profile.args[-1]
    assert json.loads(arg) == {
        "profiler": "torch",
        "torch_profiler_dir": "/var/lib/kimi-supervisor/traces",
        "torch_profiler_use_gzip": False,
        "torch_profiler_dump_cuda_time_total": False,
    }


def _numeric_keys() -> list[tuple[str, str]]:
    """(section, key) of every number in the configuration, found from the models."""
    from kimi_supervisor.config import Config

    out = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        if not isinstance(model, type) or not hasattr(model, "model_fields"):
            continue
        for key, f in model.model_fields.items():
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                out.append((section, key))
    return out


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e308", "-1e308"])
@pytest.mark.parametrize(("section", "key"), _numeric_keys())
def test_an_infinite_or_huge_number_anywhere_in_the_config_is_one_error_naming_the_key(
    section: str, key: str, value: str
) -> None:
    head = f"[{section}]\n"
    text = (
        MINIMAL.replace(head, f"{head}{key} = {value}\n")
        if head in MINIMAL
        else f"{MINIMAL}{head}{key} = {value}\n"
    )
    errs = errors_of(text)
    assert len(errs) == 1 and errs[0].startswith(f"test.toml: {section}.{key}: "), errs


def test_every_number_in_the_config_has_a_stated_range() -> None:
    assert len(_numeric_keys()) > 30  # the walk above found the fields
    from kimi_supervisor.config import Config

    for section, key in _numeric_keys():
        model = Config.model_fields[section].annotation
        meta = model.model_fields[key].metadata  # type: ignore[union-attr]
        assert any(hasattr(m, "le") or hasattr(m, "lt") for m in meta), f"{section}.{key}"


def test_an_invalid_regular_expression_is_refused_by_check_config(tmp_path: Path) -> None:
    errs = errors_of(MINIMAL + '[teardown]\nstray_patterns = ["vllm(", "ok"]\n')
    assert len(errs) == 1 and "teardown.stray_patterns" in errs[0], errs
    assert "'vllm(' is not a valid regular expression" in errs[0]
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL + "[teardown]\nterm_grace_s = inf\n")
    r = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor.cli.admin", "check-config", str(bad)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "teardown.term_grace_s" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('shm_patterns = ["*"]', "teardown.shm_patterns: '*' matches almost anything"),
        ('tmp_patterns = ["?*-*"]', "teardown.tmp_patterns: '?*-*' matches almost"),
        ('tmp_patterns = ["../etc*"]', "teardown.tmp_patterns: '../etc*': a name"),
    ],
)
def test_a_leftover_pattern_that_would_remove_anything_is_refused(line: str, says: str) -> None:
    # The daemon removes what these match, as root.
    (err,) = errors_of(MINIMAL + f"[teardown]\n{line}\n")
    assert err.startswith(f"test.toml: {says}"), err


def test_an_empty_tmp_dir_turns_the_tmpdir_leftovers_off() -> None:
    config = parse_config(MINIMAL + '[teardown]\ntmp_dir = ""\n', "test.toml")
    assert config.teardown.tmp_dir is None


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("shm_dir", "/", "system directory"),
        ("shm_dir", "/etc", "system directory"),
        ("tmp_dir", "/usr/lib", "system directory"),
        ("tmp_dir", "/proc/1", "system directory"),
        ("shm_dir", "/dev/../etc", "'/etc' is a system directory"),
        ("shm_dir", "dev/shm", "is relative"),
    ],
)
def test_a_leftovers_directory_must_be_an_absolute_scratch_directory(
    key: str, value: str, said: str
) -> None:
    """The daemon removes entries there as root (`shm_dir = "/"` was once accepted)."""
    (line,) = [e for e in errors_of(MINIMAL + f'[teardown]\n{key} = "{value}"\n') if key in e]
    assert said in line


def test_the_usual_scratch_directories_are_accepted_as_leftovers_directories() -> None:
    text = MINIMAL + '[teardown]\nshm_dir = "/dev/shm"\ntmp_dir = "/var/tmp/vllm"\n'
    t = parse_config(text, "test.toml").teardown
    assert (str(t.shm_dir), str(t.tmp_dir)) == ("/dev/shm", "/var/tmp/vllm")


def test_a_fifo_or_a_device_given_as_the_config_is_refused_at_once_not_waited_on(
    tmp_path: Path,
) -> None:
    """Before, check-config hung on a FIFO and on /dev/zero."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert "not a regular file" in str(e.value)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="not a configuration file"):
        load_config(big)


def test_a_nul_byte_in_a_config_string_is_refused_naming_the_key() -> None:
    (line,) = errors_of(MINIMAL + '[teardown]\nshm_dir = "/dev/shm\\u0000/x"\n')
    assert "teardown.shm_dir" in line and "NUL byte" in line


def test_toml_nested_too_deeply_is_an_error_not_a_traceback() -> None:
    (line,) = errors_of("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "nested too deeply" in line or "not valid TOML" in line


@pytest.mark.parametrize(
    ("vllm", "says"),
    [
        ("missing", "does not exist"),
        ("not-executable", "is not executable"),
        ("a-directory", "is not a file"),
        ("executable", ""),
    ],
)
@pytest.mark.parametrize("startable", [[], ["--startable"]])
def test_check_config_fails_for_a_vllm_that_is_not_an_executable_file(
    tmp_path: Path, vllm: str, says: str, startable: list[str]
) -> None:
    """The package starts the daemon on a first install only when --startable passes; a plain
    check-config fails for it too."""
    binary = tmp_path / "vllm"
    text = runnable(tmp_path)
    binary.unlink()
    if vllm == "not-executable":
        binary.write_text("#!/bin/sh\n")
    elif vllm == "a-directory":
        binary.mkdir()
    elif vllm == "executable":
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    src = tmp_path / "c.toml"
    src.write_text(text)
    r = check_config(src, *startable)
    if vllm == "executable":
        assert r.returncode == 0 and r.stderr == "", r.stderr
    else:
        assert r.returncode == 1
        assert f"vllm.command[0] {binary} {says}" in r.stderr
        assert f"# FAIL vllm executable: vllm.command[0] {binary} {says}" in r.stdout


def test_the_config_manual_documents_every_key_with_its_default_and_a_description() -> None:
    """kimi-supervisor.toml(5) comes from the model: a new key without a comment above it in
    config.py fails here, and every default shown is the one the daemon uses."""
    from kimi_supervisor.cli import configdoc
    from kimi_supervisor.config import Config

    rows = configdoc.keys()
    missing = [f"{sec}.{key}" for sec, key, _t, _d, what in rows if not what]
    assert missing == [], f"give these keys a comment in config.py: {missing}"
    documented = {f"{sec}.{key}" for sec, key, *_ in rows}
    effective = parse_config(MINIMAL)
    for section, f in Config.model_fields.items():
        for key in f.annotation.model_fields:  # type: ignore[union-attr]
            if section != "modes":
                assert f"{section}.{key}" in documented, (section, key)
    page = configdoc.render()
    assert "term_grace_s\\fR = 30.0  (number)" in page
    assert f"port\\fR = {effective.metrics.port}" in page and ".SH EXAMPLES" in page


def test_two_modes_that_start_vllm_alike_are_refused_with_why(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        '[vllm]\ncommand = ["/v", "serve", "m"]\n'
        '[modes.production]\nargs = ["--profiler-config", "{}"]\n'
        '[modes.profile]\nargs = ["--profiler-config", "{}"]\n'
    )
    with pytest.raises(ConfigError, match="tells the modes apart by their argv"):
        load_config(p)


@pytest.mark.parametrize(
    ("host", "url"),
    [
        pytest.param("127.0.0.1", "http://127.0.0.1:8000", id="an IPv4 address as it is"),
        pytest.param("::1", "http://[::1]:8000", id="an IPv6 address in brackets"),
        pytest.param("127.1", "http://127.0.0.1:8000", id="a short IPv4 form as its one literal"),
    ],
)
def test_vllm_is_reached_at_its_one_literal_address(host: str, url: str) -> None:
    from kimi_supervisor.config import VllmConfig

    v = VllmConfig(command=["/opt/vllm/bin/vllm", "serve", "m"], host=host)
    assert v.url == url and v.health_url == f"{url}/health"
