/*
 * selftest.c - sanity check for the NVMe test guest (see selftest.sh).
 *
 * Opens /dev/ng0n1 (NVMe generic char device), issues NVME_IOCTL_ID and an
 * Identify Namespace (CNS 0) admin passthrough, prints nsze and the LBA
 * size, and exits 0 iff the LBA size equals argv[1].
 * Build: gcc -static -O2 -Wall -o selftest selftest.c
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/nvme_ioctl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	const char *dev = argc > 2 ? argv[2] : "/dev/ng0n1";
	static uint8_t id[4096] __attribute__((aligned(4096)));
	struct nvme_admin_cmd cmd;
	unsigned long expect;
	uint64_t nsze;
	uint8_t flbas, ds;
	int fd, nsid, ret;

	if (argc < 2) {
		fprintf(stderr, "usage: %s EXPECTED_LBA_SIZE [DEV]\n", argv[0]);
		return 2;
	}
	expect = strtoul(argv[1], NULL, 0);
	fd = open(dev, O_RDONLY);
	if (fd < 0) {
		fprintf(stderr, "open %s: %s\n", dev, strerror(errno));
		return 3;
	}
	nsid = ioctl(fd, NVME_IOCTL_ID);
	if (nsid < 0) {
		fprintf(stderr, "NVME_IOCTL_ID: %s\n", strerror(errno));
		return 4;
	}
	memset(&cmd, 0, sizeof(cmd));
	cmd.opcode = 0x06; /* Identify */
	cmd.nsid = 1;
	cmd.addr = (uint64_t)(uintptr_t)id;
	cmd.data_len = sizeof(id);
	cmd.cdw10 = 0; /* CNS 0: Identify Namespace */
	ret = ioctl(fd, NVME_IOCTL_ADMIN_CMD, &cmd);
	if (ret != 0) {
		if (ret < 0)
			fprintf(stderr, "NVME_IOCTL_ADMIN_CMD: %s\n", strerror(errno));
		else
			fprintf(stderr, "Identify failed: NVMe status %#x\n", ret);
		return 5;
	}
	memcpy(&nsze, id, sizeof(nsze)); /* little-endian host */
	flbas = id[26];
	ds = id[128 + 4 * (flbas & 0xf) + 2];
	printf("nsid=%d nsze=%llu flbas=%#x lba_size=%lu\n", nsid,
	       (unsigned long long)nsze, flbas, 1UL << ds);
	close(fd);
	if ((1UL << ds) != expect) {
		fprintf(stderr, "LBA size %lu != expected %lu\n", 1UL << ds, expect);
		return 1;
	}
	return 0;
}
