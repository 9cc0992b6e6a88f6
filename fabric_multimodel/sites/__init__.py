"""Simulated sites joined by a slow link: run a training script as S nodes on this machine, each node
in its own network namespace, with every node's link to the others limited to a rate in each direction.

Run it as root (it makes network namespaces)::

    python -m fabric_multimodel.sites --sites 2 --devices 2 --bandwidth 100mbit -- \\
        examples/lm_fabric.py --steps 200 --period 16

or from Python, for benchmarks and tests::

    from fabric_multimodel.sites import run_sites

    result = run_sites("examples/lm_fabric.py", ["--steps", "60"], sites=2, devices=1, bandwidth="20mbit")
    print(result.code, result.measured_mbit_s, result.logs[0])

Each site runs ``fabric run --accelerator cpu --devices D --num-nodes S --node-rank r --main-address
10.77.0.1 --main-port P SCRIPT ARGS`` (or an elastic ``torchrun``) inside its namespace, with
``GLOO_SOCKET_IFNAME=eth0``: gloo traffic between sites crosses the limited links, while traffic
between the processes of one site goes to the site's own address, which the kernel routes over
``lo``: it never reaches the qdisc and is not limited (the tests measure both).

``--launcher live`` starts every site as a ``fabric run`` world of its own instead, and the coordinator of
a live membership (``python -m fabric_multimodel.coordinator``) in one more namespace, behind the same kind of
link; the script gets ``--coordinator ADDRESS:PORT --site S``. Any site may then be dropped (``--drop-site 0``
too), and ``--churn EVERY:DOWN`` drops them in turn while the others train on::

    python -m fabric_multimodel.sites --sites 3 --devices 1 --bandwidth 10mbit --launcher live --churn 60:20 -- \
        examples/lm_fabric.py --steps 20000 --period 128 --outer nesterov --min-sites 3

The tool in its rooms, each needing only the standard library:

- :mod:`~fabric_multimodel.sites.network`: the namespaces, the bridge, the ``tbf`` limits, the rates, a link's
  measurement;
- :mod:`~fabric_multimodel.sites.cpu`: slower sites, a cgroup CPU quota per site;
- :mod:`~fabric_multimodel.sites.processes`: each site's launcher, its command and environment, its exit code;
- :mod:`~fabric_multimodel.sites.run`: one run from the first namespace to the last cleanup (failures, drops,
  a site that joins late, the timeout, signals);
- :mod:`~fabric_multimodel.sites.cli`: the command line.
"""

from fabric_multimodel.plan.rates import RATE_FORMS, format_rate, parse_rate
from fabric_multimodel.sites.cli import main, parse_arguments
from fabric_multimodel.sites.network import (
    Sites,
    SitesError,
    kill_namespace,
    measure_link,
    namespace_pids,
    socket_in,
    tbf_settings,
)
from fabric_multimodel.sites.processes import script_code, shell_code, site_command, site_environment
from fabric_multimodel.sites.run import (
    FAILURE_GRACE_S,
    STOP_GRACE_S,
    TIMEOUT_CODE,
    Churn,
    Drop,
    Join,
    SitesResult,
    Terminated,
    preconditions,
    run_sites,
)

__all__ = [
    "FAILURE_GRACE_S",
    "RATE_FORMS",
    "STOP_GRACE_S",
    "TIMEOUT_CODE",
    "Churn",
    "Drop",
    "Join",
    "Sites",
    "SitesError",
    "SitesResult",
    "Terminated",
    "format_rate",
    "kill_namespace",
    "main",
    "measure_link",
    "namespace_pids",
    "parse_arguments",
    "parse_rate",
    "preconditions",
    "run_sites",
    "script_code",
    "shell_code",
    "site_command",
    "site_environment",
    "socket_in",
    "tbf_settings",
]
