# The passkey task with short segments only: the answer can never read a key more than one
# 256-token segment back (the segment lengths divide each other, so no number of layers
# crosses a segment boundary). Same model and budget as config/passkey.py.
#   python train.py config/passkey_short.py
out_dir = "out-passkey-short"
dataset = "passkey"
passkey_digits = 5
eval_interval = 100
eval_iters = 8
log_interval = 10

batch_size = 16
block_size = 2048

n_layer = 4
n_head = 8
n_embd = 128
dropout = 0.0

attention_backend = "auto"
segment_lengths = [64, 256]
dilation_rates = [1, 2]

learning_rate = 1e-3
max_iters = 3000
lr_decay_iters = 3000
warmup_iters = 100
min_lr = 1e-4
beta2 = 0.99
weight_decay = 0.1
