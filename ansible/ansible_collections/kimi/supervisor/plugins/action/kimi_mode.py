# Copyright: the kimi-supervisor authors
# Apache License 2.0 (see LICENSE, or https://www.apache.org/licenses/LICENSE-2.0)
"""The controller's half of kimi_mode: run the module on the host, then, for a capture with
`fetch_to`, copy its files back over the task's own connection (as ansible.builtin.fetch does)
to FETCH_TO/<inventory_hostname>/<capture folder>/."""

from __future__ import annotations

import os
import posixpath

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        result.update(
            self._execute_module(
                module_name="kimi.supervisor.kimi_mode",
                module_args=self._task.args,
                task_vars=task_vars,
            )
        )
        fetch_to = self._task.args.get("fetch_to")
        capture = result.get("capture") or {}
        if result.get("failed") or not fetch_to or not capture.get("folder"):
            return result
        host = (task_vars or {}).get("inventory_hostname", "host")
        folder = capture["folder"]
        dest = os.path.join(
            os.path.abspath(os.path.expanduser(fetch_to)), host, posixpath.basename(folder)
        )
        names = [f["name"] for f in capture.get("files", [])]
        names += ["summary.json"] if capture.get("summary") else []
        fetched = []
        try:
            os.makedirs(dest, exist_ok=True)
            for name in names:
                if "/" in name or name in ("", ".", ".."):
                    raise AnsibleError(f"the host named a capture file {name!r}: not fetched")
                local = os.path.join(dest, name)
                self._connection.fetch_file(posixpath.join(folder, name), local)
                fetched.append(local)
        except (AnsibleError, OSError) as e:
            result.update(
                failed=True,
                msg=f"the capture is on the host in {folder}, but fetching it to {dest} "
                f"failed after {len(fetched)} of {len(names)} file(s): {e}",
            )
        result["fetched_to"] = dest
        result["fetched"] = fetched
        return result
