"""L4: the jobs users run (training lab, recipe comparison, dot-product SNR study, debugger)."""
