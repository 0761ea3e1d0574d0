package controlplane

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sync"

	kubeapiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
)

// kube-apiserver's test server keeps its self-signed serving certificate as
// a "fixture" in the testdata directory beside its own source file, found
// through runtime.Caller: in the Go module cache
// ($GOMODCACHE/k8s.io/kubernetes@v1.37.1/cmd/kube-apiserver/app/testing/testdata).
// A binary on a machine without that module cache failed there ("failed to
// write cert fixture ... no such file or directory"), and one beside it wrote
// into it. The harness takes the directory from Bazel's TEST_SRCDIR and
// TEST_WORKSPACE when they are set (testserver.go, pkgPath); devcluster sets
// them to a temporary directory of this process, so that the certificates
// live there and nothing outside it is read or written.
const certFixtureWorkspace = "apiserver"

var certFixtures struct {
	sync.Mutex
	dir   string
	users int
}

// AcquireCertFixtures points the API server's certificate fixtures at this
// process's temporary directory, made by the first cluster; release removes
// it after the last cluster.
func AcquireCertFixtures() (release func(), err error) {
	certFixtures.Lock()
	defer certFixtures.Unlock()
	if certFixtures.users == 0 {
		dir, err := os.MkdirTemp("", "devcluster-certs-")
		if err != nil {
			return nil, fmt.Errorf("a directory for the API server's certificates: %w", err)
		}
		fixtures := certFixtureDir(dir)
		if err := os.MkdirAll(fixtures, 0o700); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("a directory for the API server's certificates: %w", err)
		}
		for k, v := range map[string]string{"TEST_SRCDIR": dir, "TEST_WORKSPACE": certFixtureWorkspace} {
			if err := os.Setenv(k, v); err != nil {
				_ = os.RemoveAll(dir)
				return nil, err
			}
		}
		certFixtures.dir = dir
	}
	certFixtures.users++
	var once sync.Once
	return func() {
		once.Do(func() {
			certFixtures.Lock()
			defer certFixtures.Unlock()
			certFixtures.users--
			if certFixtures.users == 0 {
				_ = os.RemoveAll(certFixtures.dir)
				_ = os.Unsetenv("TEST_SRCDIR")
				_ = os.Unsetenv("TEST_WORKSPACE")
				certFixtures.dir = ""
			}
		})
	}, nil
}

// certFixtureDir is where, under root (TEST_SRCDIR), the API server's test
// harness keeps its certificates: root/<workspace>/<the harness's source
// directory as compiled in>/testdata.
func certFixtureDir(root string) string {
	return filepath.Join(root, certFixtureWorkspace, filepath.Dir(testServerSource()), "testdata")
}

// testServerSource is the path of the harness's source file as the binary
// records it, the same path its runtime.Caller(0) returns.
func testServerSource() string {
	f := runtime.FuncForPC(reflect.ValueOf(kubeapiservertesting.StartTestServer).Pointer())
	file, _ := f.FileLine(f.Entry())
	return file
}
