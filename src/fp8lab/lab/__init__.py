"""L7: the jobs users run (training lab, recipe comparison, dot-product SNR study). The lab
returns results as plain data; it never imports ``fp8lab.report`` or ``fp8lab.cli``."""
