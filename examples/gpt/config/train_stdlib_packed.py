# Packed documents: train_stdlib.py with rows of 512 bytes, each filled with pieces of about four
# files of the standard library drawn at random. Attention never crosses a file boundary and the
# loss skips the targets that would. `python train.py config/train_stdlib_packed.py`.
out_dir = "out-stdlib-packed"
dataset = "stdlib"
packed = True
eval_interval = 50
eval_iters = 10
log_interval = 10

batch_size = 4
block_size = 512

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

# A dense local branch and sparser longer ones; the largest segment covers the whole row.
attention_backend = "auto"
segment_lengths = [64, 128, 256, 512]
dilation_rates = [1, 2, 4, 8]

learning_rate = 2e-3
max_iters = 250
lr_decay_iters = 250
warmup_iters = 20
min_lr = 2e-4
beta2 = 0.99
