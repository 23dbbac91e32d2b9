from my_block import Block
from tblock_cli.pytest_plugin import check_items
test_block = check_items(Block, d_model=64, n_heads=4, causal=True)
