/* Two metaroce devices in one process, a connected QP pair, one SEND of a
 * greeting and one RDMA WRITE, both checked. Built and run by the crate's
 * tests:
 *   cc -I metaroce-nccl/include metaroce-nccl/examples/c/hello.c \
 *      -L target/debug -lmetaroce_nccl -Wl,-rpath,target/debug -o hello
 */
#include <stdio.h>
#include <string.h>
#include "metaroce.h"

#define CHECK(call)                                                        \
  do {                                                                     \
    int rc_ = (call);                                                      \
    if (rc_ != METAROCE_OK) {                                              \
      fprintf(stderr, "%s failed: %d (%s)\n", #call, rc_,                  \
              metaroce_last_error());                                      \
      return 1;                                                            \
    }                                                                      \
  } while (0)

/* Polls `cq` until one completion is in; 0 if it succeeded. */
static int wait_one(MetaroceCq *cq, MetaroceWc *wc) {
  for (long i = 0; i < 100000000L; i++) {
    int n = metaroce_poll_cq(cq, wc, 1);
    if (n < 0) return n;
    if (n == 1) return wc->status == 0 ? 0 : 1;
  }
  return 1;
}

int main(void) {
  MetaroceDevice *a, *b;
  CHECK(metaroce_device_open("127.0.0.1:0", &a));
  CHECK(metaroce_device_open("127.0.0.1:0", &b));
  char addr[64];
  CHECK(metaroce_device_local_addr(b, addr, sizeof addr));

  MetaroceConn *ca, *cb;
  CHECK(metaroce_connect(a, addr, &ca));
  CHECK(metaroce_accept(b, &cb));

  MetarocePd *pa, *pb;
  MetaroceCq *qa_cq, *qb_cq;
  MetaroceQp *qa, *qb;
  CHECK(metaroce_pd_alloc(a, &pa));
  CHECK(metaroce_pd_alloc(b, &pb));
  CHECK(metaroce_cq_create(a, 64, &qa_cq));
  CHECK(metaroce_cq_create(b, 64, &qb_cq));
  CHECK(metaroce_qp_create(pa, qa_cq, qa_cq, &qa));
  CHECK(metaroce_qp_create(pb, qb_cq, qb_cq, &qb));
  /* QP numbers cross out of band; here, in the same process. */
  CHECK(metaroce_qp_connect(qa, ca, metaroce_qp_num(qb)));
  CHECK(metaroce_qp_connect(qb, cb, metaroce_qp_num(qa)));

  const char msg[] = "hello from C over metaroce";
  MetaroceMr *src, *dst;
  CHECK(metaroce_mr_reg(pa, 4096, 0, &src));
  CHECK(metaroce_mr_reg(pb, 4096,
                        METAROCE_ACCESS_LOCAL_WRITE | METAROCE_ACCESS_REMOTE_WRITE,
                        &dst));
  CHECK(metaroce_mr_write(src, 0, (const uint8_t *)msg, sizeof msg));

  /* SEND into a posted receive. */
  MetaroceSge rs, ss;
  CHECK(metaroce_mr_sge(dst, 0, 1024, &rs));
  CHECK(metaroce_mr_sge(src, 0, sizeof msg, &ss));
  CHECK(metaroce_post_recv(qb, 7, &rs));
  CHECK(metaroce_post_send(qa, 8, METAROCE_OP_SEND_IMM, &ss, NULL, 42));
  MetaroceWc wc;
  if (wait_one(qa_cq, &wc) || wc.wr_id != 8) { fprintf(stderr, "send failed\n"); return 1; }
  if (wait_one(qb_cq, &wc) || wc.wr_id != 7 || wc.byte_len != sizeof msg ||
      !wc.has_imm || wc.imm != 42) {
    fprintf(stderr, "receive: wr_id %llu len %u imm %u\n",
            (unsigned long long)wc.wr_id, wc.byte_len, wc.imm);
    return 1;
  }
  char got[sizeof msg];
  CHECK(metaroce_mr_read(dst, 0, (uint8_t *)got, sizeof got));
  if (memcmp(got, msg, sizeof msg) != 0) { fprintf(stderr, "SEND bytes differ\n"); return 1; }

  /* RDMA WRITE to offset 2048 of the peer's region. */
  MetaroceRemote remote;
  CHECK(metaroce_mr_remote(dst, &remote));
  remote.addr += 2048;
  CHECK(metaroce_post_send(qa, 9, METAROCE_OP_WRITE, &ss, &remote, 0));
  if (wait_one(qa_cq, &wc) || wc.wr_id != 9) { fprintf(stderr, "write failed\n"); return 1; }
  CHECK(metaroce_mr_read(dst, 2048, (uint8_t *)got, sizeof got));
  if (memcmp(got, msg, sizeof msg) != 0) { fprintf(stderr, "WRITE bytes differ\n"); return 1; }

  /* An error comes back as a code and a message. */
  if (metaroce_post_send(qa, 10, METAROCE_OP_WRITE, &ss, NULL, 0) != METAROCE_EINVAL ||
      strlen(metaroce_last_error()) == 0) {
    fprintf(stderr, "a WRITE without a remote address was not refused\n");
    return 1;
  }

  metaroce_mr_free(src);
  metaroce_mr_free(dst);
  metaroce_qp_free(qa);
  metaroce_qp_free(qb);
  metaroce_cq_free(qa_cq);
  metaroce_cq_free(qb_cq);
  metaroce_pd_free(pa);
  metaroce_pd_free(pb);
  metaroce_conn_free(ca);
  metaroce_conn_free(cb);
  metaroce_device_close(a);
  metaroce_device_close(b);
  printf("%s\n", got);
  return 0;
}
