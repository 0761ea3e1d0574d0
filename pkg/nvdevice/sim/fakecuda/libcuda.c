/*
 * A stand-in for the NVIDIA driver's libcuda.so.1 (issue 34), for the
 * simulated driver root (pkg/nvdevice/sim: Machine.WriteDriverRoot with
 * DriverStandIns.LibCUDA). It exports the driver API calls that
 * gpudra-cuda-check makes, with their real names and signatures, and
 * behaves as the real driver does as far as a process in a container can
 * tell:
 *
 *   - the devices are the GPUs whose character device (major 195, the
 *     minor of the GPU) the process has under /dev, named anything
 *     /dev/nvidia<N>, that the device cgroup lets it open (EPERM: not
 *     usable); no /dev/nvidiactl or no such GPU: cuInit fails with
 *     CUDA_ERROR_NO_DEVICE. Ordered by PCI bus id, then narrowed by
 *     CUDA_VISIBLE_DEVICES (ordinals or UUIDs, up to the first invalid
 *     entry), as CUDA does;
 *   - a GPU's name, UUID and memory come from the machine's device table,
 *     which the simulated driver root appends to this library's own file
 *     (the kernel driver's knowledge on a real host: the same for every
 *     container of the node, and nothing a container's environment sets);
 *   - cuMemAlloc_v2 fails with CUDA_ERROR_OUT_OF_MEMORY above what is left
 *     of the device's memory, and, for an MPS client (an MPS control
 *     daemon's "control" pipe in CUDA_MPS_PIPE_DIRECTORY, else
 *     /tmp/nvidia-mps) with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT set
 *     ("0=8192M", "0=8G,1=4G" or "8G", binary units; "8GB" is ignored, as
 *     by the real MPS; a bare number is taken as bytes, unverified), above
 *     what is left of that limit, as MPS enforces it on a real H100 and
 *     H200. Without a daemon the variable is ignored, as by the real
 *     driver. No memory is allocated: device pointers are addresses in a
 *     range nothing maps.
 *
 * GPUDRA_FAKECUDA_DEV names another directory than /dev (tests outside a
 * container). Built with: gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1
 * -o libcuda.so libcuda.c
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct CUuuid_st {
	char bytes[16];
} CUuuid;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_UNKNOWN = 999,
};

#define NVIDIA_MAJOR 195
#define MAX_GPUS 64
#define MAX_ALLOCS 1024
#define TABLE_MARK "\n#gpudra-fakecuda-table v1\n"

struct gpu {
	int minor;
	char bus[32];
	unsigned char uuid[16];
	char uuid_text[64];
	unsigned long long memory;
	char name[96];
};

struct ctx {
	int device;
};

static struct gpu table[MAX_GPUS];
static int table_len;
static int cuda_version;
static int table_read; /* 1 read, -1 no table */

static struct gpu *devices[MAX_GPUS]; /* visible devices, by ordinal */
static int device_count;
static unsigned long long used[MAX_GPUS];
static unsigned long long limit[MAX_GPUS]; /* 0: none */
static struct ctx contexts[MAX_GPUS];

static struct {
	CUdeviceptr ptr;
	unsigned long long size;
	int device;
} allocs[MAX_ALLOCS];
static CUdeviceptr next_ptr = 0x7f0000000000ULL;

static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread struct ctx *current;

static int hexval(int c) {
	if (c >= '0' && c <= '9')
		return c - '0';
	c = tolower(c);
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

/* parse_uuid reads "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx". */
static int parse_uuid(const char *s, unsigned char out[16]) {
	if (strncmp(s, "GPU-", 4) == 0)
		s += 4;
	int n = 0;
	for (; *s && n < 32; s++) {
		if (*s == '-')
			continue;
		int v = hexval(*s);
		if (v < 0)
			return -1;
		if (n % 2 == 0)
			out[n / 2] = (unsigned char)(v << 4);
		else
			out[n / 2] |= (unsigned char)v;
		n++;
	}
	return n == 32 ? 0 : -1;
}

/*
 * read_table finds the device table after this library's code in its own
 * file:
 *   #gpudra-fakecuda-table v1
 *   cuda <version, 12080 for 12.8>
 *   gpu <minor> <PCI bus id> <GPU-uuid> <memory bytes> <name...>
 *   #end
 */
static void read_table(void) {
	Dl_info info;
	if (!dladdr((void *)read_table, &info) || !info.dli_fname) {
		fprintf(stderr, "fakecuda: cannot find the library's own file\n");
		table_read = -1;
		return;
	}
	FILE *f = fopen(info.dli_fname, "rb");
	if (!f) {
		fprintf(stderr, "fakecuda: open %s: %s\n", info.dli_fname, strerror(errno));
		table_read = -1;
		return;
	}
	size_t cap = 1 << 16, len = 0;
	char *buf = malloc(cap + 1);
	size_t n;
	while (buf && (n = fread(buf + len, 1, cap - len, f)) > 0) {
		len += n;
		if (len == cap) {
			cap *= 2;
			char *b = realloc(buf, cap + 1);
			if (!b)
				free(buf);
			buf = b;
		}
	}
	fclose(f);
	if (!buf) {
		table_read = -1;
		return;
	}
	buf[len] = 0;
	char *start = NULL;
	for (char *p = buf; (p = memmem(p, len - (size_t)(p - buf), TABLE_MARK, strlen(TABLE_MARK))) != NULL; p++)
		start = p;
	if (!start) {
		fprintf(stderr, "fakecuda: %s carries no device table (the simulated driver root appends it: sim.Machine.WriteDriverRoot)\n",
			info.dli_fname);
		free(buf);
		table_read = -1;
		return;
	}
	char *line = start + strlen(TABLE_MARK);
	while (line && *line && table_len < MAX_GPUS) {
		char *end = strchr(line, '\n');
		if (end)
			*end = 0;
		if (strcmp(line, "#end") == 0)
			break;
		struct gpu g;
		memset(&g, 0, sizeof g);
		int off = 0;
		if (sscanf(line, "cuda %d", &cuda_version) == 1) {
			/* the CUDA version the driver supports */
		} else if (sscanf(line, "gpu %d %31s %63s %llu %n", &g.minor, g.bus, g.uuid_text, &g.memory, &off) == 4 && off > 0 &&
			   parse_uuid(g.uuid_text, g.uuid) == 0) {
			snprintf(g.name, sizeof g.name, "%s", line + off);
			table[table_len++] = g;
		}
		line = end ? end + 1 : NULL;
	}
	free(buf);
	table_read = 1;
}

/* parse_size reads "8192M", "8G", "4096" (bytes): binary units K, M, G, T.
 * "8GB" is refused, as the real MPS ignores such a limit (seen on an H200
 * with driver 580.159.04). */
static int parse_size(const char *s, unsigned long long *out) {
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -1;
	unsigned long long mul = 1;
	switch (toupper((unsigned char)*end)) {
	case 0:
		break;
	case 'K':
		mul = 1ULL << 10;
		end++;
		break;
	case 'M':
		mul = 1ULL << 20;
		end++;
		break;
	case 'G':
		mul = 1ULL << 30;
		end++;
		break;
	case 'T':
		mul = 1ULL << 40;
		end++;
		break;
	default:
		return -1;
	}
	if (*end)
		return -1;
	*out = v * mul;
	return 0;
}

/* mps_active: the process is an MPS client, which it is where an MPS
 * control daemon is in the pipe directory (CUDA_MPS_PIPE_DIRECTORY, else
 * /tmp/nvidia-mps): its "control" pipe is there. Without one the limit
 * variable is ignored, as by the real driver. */
static int mps_active(void) {
	const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
	if (!dir || !*dir)
		dir = "/tmp/nvidia-mps";
	char path[4096];
	snprintf(path, sizeof path, "%s/control", dir);
	struct stat st;
	return stat(path, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

/* read_mps_limits applies CUDA_MPS_PINNED_DEVICE_MEM_LIMIT to the
 * visible devices (ordinals as the client sees them) of an MPS client. */
static void read_mps_limits(void) {
	const char *env = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
	if (!env || !*env || !mps_active())
		return;
	char *copy = strdup(env), *save = NULL;
	for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
		char *eq = strchr(item, '=');
		unsigned long long v;
		if (!eq) {
			if (parse_size(item, &v) == 0)
				for (int i = 0; i < device_count; i++)
					limit[i] = v;
			continue;
		}
		*eq = 0;
		char *end;
		long ord = strtol(item, &end, 10);
		if (*end || end == item || ord < 0 || ord >= device_count || parse_size(eq + 1, &v) != 0)
			continue;
		limit[ord] = v;
	}
	free(copy);
}

static int by_bus(const void *a, const void *b) {
	return strcmp((*(struct gpu *const *)a)->bus, (*(struct gpu *const *)b)->bus);
}

/* apply_visible narrows the devices to CUDA_VISIBLE_DEVICES: ordinals or
 * UUIDs (a unique prefix of "GPU-..."), up to the first invalid entry. */
static void apply_visible(void) {
	const char *env = getenv("CUDA_VISIBLE_DEVICES");
	if (!env)
		return;
	struct gpu *out[MAX_GPUS];
	int n = 0;
	char *copy = strdup(env), *save = NULL;
	for (char *item = strtok_r(copy, ",", &save); item && n < MAX_GPUS; item = strtok_r(NULL, ",", &save)) {
		while (isspace((unsigned char)*item))
			item++;
		struct gpu *g = NULL;
		char *end;
		long ord = strtol(item, &end, 10);
		if (end != item && *end == 0) {
			if (ord >= 0 && ord < device_count)
				g = devices[ord];
		} else {
			int matches = 0;
			for (int i = 0; i < device_count; i++)
				if (strncmp(devices[i]->uuid_text, item, strlen(item)) == 0) {
					g = devices[i];
					matches++;
				}
			if (matches != 1)
				g = NULL;
		}
		int dup = 0;
		for (int i = 0; g && i < n; i++)
			dup |= out[i] == g;
		if (!g || dup)
			break;
		out[n++] = g;
	}
	free(copy);
	memcpy(devices, out, sizeof(out[0]) * (size_t)n);
	device_count = n;
}

static void do_init(void) {
	pthread_once(&table_once, read_table);
	if (table_read < 0) {
		init_result = CUDA_ERROR_UNKNOWN;
		return;
	}
	const char *dev = getenv("GPUDRA_FAKECUDA_DEV");
	if (!dev || !*dev)
		dev = "/dev";
	char path[4096];
	snprintf(path, sizeof path, "%s/nvidiactl", dev);
	struct stat st;
	if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode)) {
		init_result = CUDA_ERROR_NO_DEVICE;
		return;
	}
	DIR *d = opendir(dev);
	if (!d) {
		init_result = CUDA_ERROR_NO_DEVICE;
		return;
	}
	struct dirent *e;
	while ((e = readdir(d)) != NULL && device_count < MAX_GPUS) {
		const char *digits = e->d_name + strlen("nvidia");
		if (strncmp(e->d_name, "nvidia", 6) != 0 || !*digits || strspn(digits, "0123456789") != strlen(digits))
			continue;
		snprintf(path, sizeof path, "%s/%s", dev, e->d_name);
		if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != NVIDIA_MAJOR)
			continue;
		/* The device cgroup decides, as for the real driver's open: EPERM
		 * is a node the container may not use; ENXIO is a node the cgroup
		 * allows with no driver behind it (the simulator's). */
		int fd = open(path, O_RDWR);
		if (fd >= 0)
			close(fd);
		else if (errno == EPERM)
			continue;
		for (int i = 0; i < table_len; i++) {
			if (table[i].minor != (int)minor(st.st_rdev))
				continue;
			int dup = 0;
			for (int j = 0; j < device_count; j++)
				dup |= devices[j] == &table[i];
			if (!dup)
				devices[device_count++] = &table[i];
		}
	}
	closedir(d);
	qsort(devices, (size_t)device_count, sizeof devices[0], by_bus);
	apply_visible();
	if (device_count == 0) {
		init_result = CUDA_ERROR_NO_DEVICE;
		return;
	}
	read_mps_limits();
	init_result = CUDA_SUCCESS;
}

#define REQUIRE_INIT()                                                                                                 \
	do {                                                                                                           \
		if (init_result != CUDA_SUCCESS)                                                                      \
			return init_result == CUDA_ERROR_NO_DEVICE ? CUDA_ERROR_NO_DEVICE : CUDA_ERROR_NOT_INITIALIZED; \
	} while (0)

#define REQUIRE_DEVICE(dev)                                                                                            \
	do {                                                                                                           \
		REQUIRE_INIT();                                                                                        \
		if ((dev) < 0 || (dev) >= device_count)                                                               \
			return CUDA_ERROR_INVALID_DEVICE;                                                              \
	} while (0)

CUresult cuInit(unsigned int flags) {
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_once(&init_once, do_init);
	return init_result;
}

CUresult cuDriverGetVersion(int *version) {
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_once(&table_once, read_table);
	*version = cuda_version;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
	if (!count)
		return CUDA_ERROR_INVALID_VALUE;
	if (init_result != CUDA_SUCCESS && init_result != CUDA_ERROR_NO_DEVICE)
		return CUDA_ERROR_NOT_INITIALIZED;
	*count = device_count;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
	if (!device)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_DEVICE(ordinal);
	*device = ordinal;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
	if (!name || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_DEVICE(dev);
	snprintf(name, (size_t)len, "%s", devices[dev]->name);
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
	if (!uuid)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_DEVICE(dev);
	memcpy(uuid->bytes, devices[dev]->uuid, 16);
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
	if (!bytes)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_DEVICE(dev);
	*bytes = (size_t)devices[dev]->memory;
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_DEVICE(dev);
	contexts[dev].device = dev;
	*pctx = (CUcontext)&contexts[dev];
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
	REQUIRE_DEVICE(dev);
	return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
	REQUIRE_INIT();
	struct ctx *c = (struct ctx *)ctx;
	if (c && (c < contexts || c >= contexts + device_count))
		return CUDA_ERROR_INVALID_CONTEXT;
	current = c;
	return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	REQUIRE_INIT();
	if (!current)
		return CUDA_ERROR_INVALID_CONTEXT;
	int dev = current->device;
	unsigned long long size = ((unsigned long long)bytesize + 511) & ~511ULL;
	CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&mu);
	unsigned long long cap = devices[dev]->memory;
	if (limit[dev] && limit[dev] < cap)
		cap = limit[dev];
	if (size <= cap && used[dev] <= cap - size) {
		for (int i = 0; i < MAX_ALLOCS; i++) {
			if (allocs[i].ptr)
				continue;
			allocs[i].ptr = next_ptr;
			allocs[i].size = size;
			allocs[i].device = dev;
			*dptr = next_ptr;
			next_ptr += (size + 0xfffffULL) & ~0xfffffULL;
			used[dev] += size;
			r = CUDA_SUCCESS;
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
	REQUIRE_INIT();
	if (!current)
		return CUDA_ERROR_INVALID_CONTEXT;
	CUresult r = CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAX_ALLOCS; i++) {
		if (allocs[i].ptr != dptr || !dptr)
			continue;
		used[allocs[i].device] -= allocs[i].size;
		allocs[i].ptr = 0;
		r = CUDA_SUCCESS;
		break;
	}
	pthread_mutex_unlock(&mu);
	return r;
}

static const struct {
	CUresult code;
	const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

CUresult cuGetErrorName(CUresult error, const char **str) {
	if (!str)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
		if (errors[i].code == error) {
			*str = errors[i].name;
			return CUDA_SUCCESS;
		}
	*str = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
	if (!str)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
		if (errors[i].code == error) {
			*str = errors[i].text;
			return CUDA_SUCCESS;
		}
	*str = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}
