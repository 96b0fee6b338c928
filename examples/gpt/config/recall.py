# Multi-query associative recall over 2,048 tokens (recall.py): 4 key-value records, each a row
# of 8 tokens (a key, then its value 7 times), at random rows of a blank table, and 64 queries
# (keys of the table) at the end; the loss and the accuracy are on the queries' answers only.
# LongNet-style branches whose longest segment spans the block reach every record in two
# layers. longcontext.py trains this config with three attentions (make longcontext).
#   python train.py config/recall.py
out_dir = "out-recall"
dataset = "recall"
recall_pairs = 4
recall_queries = 64
recall_row = 8
recall_len_warmup = 300  # sequences grow from 256 tokens (batch 32) to 2,048 (batch 4)
eval_interval = 25
eval_iters = 2
log_interval = 10

batch_size = 4
block_size = 2048

n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.0
bias = False

attention_backend = "auto"
segment_lengths = [8, 64, 2048]
dilation_rates = [1, 2, 4]

learning_rate = 3e-3
max_iters = 2000
lr_decay_iters = 2000
warmup_iters = 30
min_lr = 3e-4
beta2 = 0.99
weight_decay = 0.1
max_minutes = 10.0  # the wall-time budget of one run (training steps; evaluations not counted)
num_threads = 1  # steadier than 2 threads on a busy 2-core machine
