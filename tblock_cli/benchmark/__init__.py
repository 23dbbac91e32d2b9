"""benchmark (the bench command): `timing` (samples, median, IQR), `profiling` (peak memory, kernel), `breakdown` (per component),
`run` (the sweep), `report` (results and findings), `saved` (--save and --compare)."""
