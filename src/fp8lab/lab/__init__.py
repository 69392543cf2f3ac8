"""L7: the jobs users run (training lab on the built-in GPT or the user's own model -- see
``fp8lab.lab.models`` --, recipe comparison, dot-product SNR study). The lab
returns results as plain data; it never imports ``fp8lab.report`` or ``fp8lab.cli``."""
