# The small default: a byte-level GPT on the Python standard library's sources, on a CPU in a
# few minutes. `python train.py config/train_stdlib.py`, then `python sample.py`.
out_dir = "out-stdlib"
dataset = "stdlib"
eval_interval = 50
eval_iters = 10
log_interval = 10

batch_size = 8
block_size = 256

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

# Dilated attention: a dense local branch and two sparser longer ones (LongNet's geometric
# progression); the largest segment covers the whole block.
attention_backend = "auto"
segment_lengths = [64, 128, 256]
dilation_rates = [1, 2, 4]

learning_rate = 2e-3
max_iters = 250
lr_decay_iters = 250
warmup_iters = 20
min_lr = 2e-4
beta2 = 0.99
