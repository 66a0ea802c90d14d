"""Source that a child process runs first to count Inductor's ISA-check subprocesses in `probes`."""

import textwrap

COUNT_ISA_PROBES = textwrap.dedent("""
    import subprocess
    import torch._inductor.cpu_vec_isa as isa
    probes = []

    class Counted:  # Inductor's ISA checks load their test program in a subprocess
        def __getattr__(self, name):
            return getattr(subprocess, name)
        def run(self, *a, **k):
            probes.append(a)
            return subprocess.run(*a, **k)
        def check_call(self, *a, **k):
            probes.append(a)
            return subprocess.check_call(*a, **k)

    isa.subprocess = Counted()
""")
