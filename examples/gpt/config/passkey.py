# Passkey retrieval over 2048 bytes: a 5-digit key hidden at a random depth in filler text,
# asked for at the end; the loss and accuracy are on the answer's digits only.
# Dilated attention whose largest segment spans the whole block can reach the key from the
# answer; compare config/passkey_short.py (short segments only) and --attention_backend=dense.
#   python train.py config/passkey.py
out_dir = "out-passkey"
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
segment_lengths = [128, 512, 2048]
dilation_rates = [1, 2, 4]

learning_rate = 1e-3
max_iters = 3000
lr_decay_iters = 3000
warmup_iters = 100
min_lr = 1e-4
beta2 = 0.99
weight_decay = 0.1
