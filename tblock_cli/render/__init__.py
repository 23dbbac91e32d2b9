"""Rich views and charts built from the reports; nothing here computes a measurement or imports torch.

`common` (console, glyphs, formats), `tables` (check, params, presets), `bench`, `depth`, `plots` (matplotlib);
`html` and `svg`: the --html page and its charts, from a report's dict.
"""

from tblock_cli.render.bench import bench_view, tp_bench_view
from tblock_cli.render.common import make_console, sparkline
from tblock_cli.render.depth import depth_compare_view, depth_view
from tblock_cli.render.plots import save_depth_plot, save_plot
from tblock_cli.render.tables import check_view, params_view, presets_view

__all__ = ["bench_view", "check_view", "depth_compare_view", "depth_view", "make_console", "params_view", "presets_view",
           "save_depth_plot", "save_plot", "sparkline", "tp_bench_view"]
