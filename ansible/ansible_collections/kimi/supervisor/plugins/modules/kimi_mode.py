#!/usr/bin/python
# Copyright: the kimi-supervisor authors
# Apache License 2.0 (see LICENSE, or https://www.apache.org/licenses/LICENSE-2.0)
"""Switch a host's vLLM between production and profile mode, or take a capture, through the
host's own `kimi-mode --json` (see DOCUMENTATION's notes for why not the socket)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: kimi_mode
short_description: Switch vLLM between production and profile mode with kimi-supervisor
version_added: "0.1.0"
description:
  - Asks the host's kimi-supervisor daemon to serve vLLM in C(production) or C(profile) mode and
    follows the switch to its end (teardown, start, /health), or takes a torch profiler capture.
  - Runs the host's own C(kimi-mode --json). The CLI installed with the daemon speaks the daemon's
    protocol version, so a controller with a newer collection can still drive a host that has not
    been upgraded yet, and the exit codes keep the meaning documented in C(kimi-mode --help).
  - Nothing is needed on the host beyond the kimi-supervisor package.
options:
  mode:
    description:
      - The mode vLLM must serve in. Required unless O(state=captured).
    type: str
    choices: [production, profile]
  state:
    description:
      - V(switched) makes vLLM serve in O(mode); nothing is done when it already does.
      - V(captured) takes a capture of O(seconds) (switching to profile mode first when O(switch)),
        then goes back to production or stays, as O(then) says.
    type: str
    choices: [switched, captured]
    default: switched
  for:
    description:
      - With O(mode=profile), go back to production by itself after this long (V(2h), V(90m),
        V(1h30m)). Asking again moves the end, so the task reports a change every time.
    type: str
  force:
    description:
      - Take over from a switch to the other mode that is in progress.
    type: bool
    default: false
  timeout:
    description:
      - Stop following a switch after this many seconds. The task fails; the switch goes on on
        the host. A capture ends by itself after O(seconds) and the flush.
    type: int
  seconds:
    description:
      - How long a capture records (O(state=captured)).
    type: float
    default: 30
  then:
    description:
      - After a capture, go back to V(production) or V(stay) in profile mode.
    type: str
    choices: [production, stay]
    default: production
  switch:
    description:
      - Switch to profile mode first when vLLM serves production (O(state=captured)).
    type: bool
    default: true
  fetch_to:
    description:
      - A directory on the controller. The capture's files are copied to
        C(FETCH_TO/<inventory_hostname>/<capture folder>/).
    type: path
  socket:
    description:
      - The daemon's control socket. Default, the one in the host's configuration.
    type: path
  config:
    description:
      - The configuration file that names the socket.
    type: path
  executable:
    description:
      - The C(kimi-mode) to run. Default, the one on the PATH or in C(/opt/kimi-supervisor/bin).
    type: path
notes:
  - Check mode reports what would change and does nothing. Diff mode shows the desired and actual
    mode.
  - Needs the caller to be root or in the daemon's control group, as C(kimi-mode) does.
  - O(fetch_to) copies the files as the connection's user. A capture belongs to whoever asked for
    it (root under become), so connect as root, or as a member of the control group without
    become.
author:
  - kimi-supervisor authors
"""

EXAMPLES = r"""
- name: Serve production
  kimi.supervisor.kimi_mode:
    mode: production

- name: Profile mode for two hours at most
  kimi.supervisor.kimi_mode:
    mode: profile
    for: 2h
    timeout: 3600

- name: Record 30 s and bring the traces to the controller
  kimi.supervisor.kimi_mode:
    state: captured
    seconds: 30
    then: stay
    fetch_to: ./captures
"""

RETURN = r"""
mode:
  description: The mode vLLM serves in at the end.
  returned: always
  type: str
previous_mode:
  description: The mode vLLM served in before the task, null when none.
  returned: always
  type: str
message:
  description: The daemon's own words on how the switch or the capture ended.
  returned: always
  type: str
outcome:
  description: The switch's outcome (ready, rolled_back, failed, stuck, ...) or captured.
  returned: when a switch or a capture ran
  type: str
teardown:
  description: The teardown report of this switch (outcome, duration_s, kills, diagnosis).
  returned: when this switch tore vLLM down
  type: dict
load_s:
  description: Seconds from starting vLLM to /health answering.
  returned: when this switch started vLLM
  type: float
transition:
  description: The switch's record, as `kimi-mode history` shows it.
  returned: when a switch ran
  type: dict
capture:
  description: The capture's end (folder, files with name, rank and bytes, summary).
  returned: with state=captured
  type: dict
rc:
  description: kimi-mode's exit code.
  returned: when kimi-mode ran
  type: int
ansible_facts:
  description: C(kimi_supervisor) with mode, state, teardown, load_s, transition and capture.
  returned: always
  type: dict
"""

import json  # noqa: E402 - after the documentation, as Ansible's modules have it
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

# kimi-mode's exit codes (kimi-mode --help, docs/control-protocol.md), as
# kimi_supervisor/cli/exits.py states them (a unit test holds this table to it).
EXIT_MEANING = {
    1: "failed: the switch or capture did not succeed, or the daemon gave up (FAILED)",
    2: "usage: the request was not valid",
    3: "the daemon is unreachable or refused the caller (root or the control group only)",
    4: "timed out: stopped following; the switch goes on on the host (kimi-mode status)",
    5: "refused: the host is busy (another switch) or in the way (wrong mode, port taken)",
    6: "STUCK: the GPUs could not be made clean; a person must look (kimi-mode status)",
    130: "interrupted: the switch goes on on the host",
    141: "output closed before the end: nothing was judged after it",
}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "mode": {"type": "str", "choices": ["production", "profile"]},
            "state": {"type": "str", "choices": ["switched", "captured"], "default": "switched"},
            "for": {"type": "str"},
            "force": {"type": "bool", "default": False},
            "timeout": {"type": "int"},
            "seconds": {"type": "float", "default": 30},
            "then": {"type": "str", "choices": ["production", "stay"], "default": "production"},
            "switch": {"type": "bool", "default": True},
            "fetch_to": {"type": "path"},
            "socket": {"type": "path"},
            "config": {"type": "path"},
            "executable": {"type": "path"},
        },
        required_if=[("state", "switched", ["mode"])],
        supports_check_mode=True,
    )
    p = module.params
    if p["for"] and p["mode"] != "profile":
        module.fail_json(msg="`for` goes with mode=profile: only profile mode ends by itself")
    if p["state"] == "captured" and p["mode"] == "production":
        module.fail_json(msg="a capture runs in profile mode: leave out mode, or set profile")
    if p["seconds"] <= 0:
        module.fail_json(msg=f"seconds must be more than 0, not {p['seconds']:g}")
    kimi = KimiMode(module)
    before = kimi.status()
    if p["state"] == "captured":
        capture(module, kimi, before)
    else:
        switch(module, kimi, before)


class KimiMode:
    """The host's kimi-mode, run with --json and the task's socket or config."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        p = module.params
        self.exe = p["executable"] or module.get_bin_path(
            "kimi-mode", required=True, opt_dirs=["/usr/local/bin", "/opt/kimi-supervisor/bin"]
        )
        self.where = ["--socket", p["socket"]] if p["socket"] else []
        self.where += ["--config", p["config"]] if p["config"] else []

    def run(self, *args: str) -> tuple[int, list[dict], str, str]:
        """kimi-mode's exit code, its JSON messages (one per line), stdout and stderr."""
        rc, out, err = self.module.run_command([self.exe, *args, "--json", *self.where])
        messages = []
        for line in out.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                messages.append(msg)
        return rc, messages, out, err

    def status(self) -> dict:
        rc, _msgs, out, err = self.run("status")
        if rc in (0, 1, 6):  # FAILED (1) or STUCK (6): the status is printed all the same
            try:
                return json.loads(out)
            except ValueError:
                pass
        self.fail(rc, err.strip() or out.strip() or "kimi-mode status printed nothing", {})

    def fail(self, rc: int, message: str, result: dict) -> None:
        meaning = EXIT_MEANING.get(rc, f"kimi-mode exited {rc}")
        self.module.fail_json(
            msg=f"{message} ({meaning})", **{**result, "rc": rc, "meaning": meaning}
        )


def serving(status: dict) -> str | None:
    return status.get("mode") if status.get("state") == "serving" else None


def facts(result: dict, status: dict) -> dict:
    return {
        "kimi_supervisor": {
            "mode": serving(status),
            "state": status.get("state"),
            **{k: result.get(k) for k in ("teardown", "load_s", "transition", "capture")},
        }
    }


def diff(before: dict, mode: str) -> dict:
    return {
        "before": f"mode: {serving(before)}\ndesired: {before.get('desired_mode')}\n"
        f"state: {before.get('state')}\n",
        "after": f"mode: {mode}\ndesired: {mode}\nstate: serving\n",
    }


def switch(module: AnsibleModule, kimi: KimiMode, before: dict) -> None:
    p = module.params
    mode = p["mode"]
    there = serving(before) == mode and before.get("desired_mode") == mode
    result = {"previous_mode": serving(before), "mode": serving(before)}
    if there and not p["for"]:
        result["message"] = f"{mode} is already serving"
        module.exit_json(changed=False, ansible_facts=facts(result, before), **result)
    if module.check_mode:
        result["message"] = (
            f"would set profile mode to end in {p['for']}" if there else f"would switch to {mode}"
        )
        module.exit_json(
            changed=True, diff=diff(before, mode), ansible_facts=facts(result, before), **result
        )
    args = [mode]
    args += ["--force"] if p["force"] else []
    args += ["--for", p["for"]] if p["for"] else []
    args += ["--timeout", str(p["timeout"])] if p["timeout"] else []
    rc, messages, _out, err = kimi.run(*args)
    result.update(followed(messages))
    after = kimi.status() if rc != 3 else before
    result["mode"] = serving(after)
    if result.get("tore_down"):
        result["teardown"] = after.get("last_teardown")
    result.pop("tore_down", None)
    result["rc"] = rc
    if rc != 0:
        kimi.fail(rc, result.get("message") or err.strip() or "the switch failed", result)
    module.exit_json(
        changed=result.get("code") != "already" or bool(p["for"]),
        diff=diff(before, mode),
        ansible_facts=facts(result, after),
        **result,
    )


def followed(messages: list) -> dict:
    """What the switch's messages say: the reply's code and message, whether a teardown ran,
    the end's outcome, message, transition record and load time."""
    out: dict = {}
    for msg in messages:
        kind = msg.get("type")
        if kind == "reply":
            out["code"], out["message"] = msg.get("code"), msg.get("message")
        elif kind == "event" and msg.get("event") == "teardown_started":
            out["tore_down"] = True
        elif kind == "end":
            data = msg.get("data") or {}
            out["outcome"], out["message"] = msg.get("outcome"), msg.get("message")
            out["transition"] = data
            if "load_s" in data:
                out["load_s"] = data["load_s"]
    return out


def capture(module: AnsibleModule, kimi: KimiMode, before: dict) -> None:
    p = module.params
    result = {"previous_mode": serving(before), "mode": serving(before)}
    if module.check_mode:
        result["message"] = f"would record {p['seconds']:g} s"
        module.exit_json(changed=True, ansible_facts=facts(result, before), **result)
    args = ["capture", "--seconds", f"{p['seconds']:g}", "--then", p["then"]]
    args += ["--switch"] if p["switch"] else []
    started = time.monotonic()
    rc, messages, _out, err = kimi.run(*args)
    ends = [m for m in messages if m.get("type") == "end"]
    replies = [m for m in messages if m.get("type") == "reply" and not m.get("ok")]
    end = next((m for m in ends if m.get("outcome") in ("captured", "capture_failed")), None)
    if end is not None:
        result["outcome"], result["message"] = end.get("outcome"), end.get("message")
        result["capture"] = end.get("data") or {}
    elif replies:
        result["message"] = replies[-1].get("message")
    result["capture_s"] = round(time.monotonic() - started, 3)
    result["rc"] = rc
    after = kimi.status() if rc != 3 else before
    result["mode"] = serving(after)
    if rc != 0 or end is None or not end.get("ok"):
        kimi.fail(rc or 1, result.get("message") or err.strip() or "the capture failed", result)
    module.exit_json(changed=True, ansible_facts=facts(result, after), **result)


if __name__ == "__main__":
    main()
