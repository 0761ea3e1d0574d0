package noderuntime

import (
	"context"
	"fmt"
	"io"
	"net"

	"runtime"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// A pod run from the image (package imagemode) has a network namespace of its
// own, as a pod has on a node: its ports are its own, so two plugin pods
// of two nodes both listen on the chart's metrics port. devcluster has no
// pod network (no CNI, no veth), so it reaches into the namespace instead:
// a socket belongs to the network namespace of the thread that creates
// it, and keeps working from any thread afterwards. ListenInNetns opens a
// listener inside the pod's namespace (the API server at 127.0.0.1, as
// kube-proxy's service address would be), DialInNetns a connection to a
// port of the pod (probes, the webhook's Service).

// InNetns runs f on a thread of its own that has entered the network
// namespace at nsPath. The thread is never given back to the Go scheduler
// (the goroutine ends locked): it dies with its namespace.
func InNetns(nsPath string, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread is in another namespace.
		fd, err := unix.Open(nsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- fmt.Errorf("open network namespace %s: %w", nsPath, err)
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("enter network namespace %s: %w", nsPath, err)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// ListenInNetns listens on addr inside the network namespace at nsPath.
func ListenInNetns(nsPath, addr string) (net.Listener, error) {
	var l net.Listener
	err := InNetns(nsPath, func() (err error) {
		l, err = net.Listen("tcp", addr)
		return err
	})
	return l, err
}

// DialInNetns connects to addr inside the network namespace at nsPath.
func DialInNetns(ctx context.Context, nsPath, addr string) (net.Conn, error) {
	var c net.Conn
	err := InNetns(nsPath, func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, "tcp", addr)
		return err
	})
	return c, err
}

// Forward serves l, copying each connection to one that dial makes, both
// ways, until ctx ends: the stand-in for a Service's address.
func Forward(ctx context.Context, l net.Listener, dial func(context.Context) (net.Conn, error)) {
	go func() {
		<-ctx.Done()
		_ = l.Close()
	}()
	for {
		in, err := l.Accept()
		if err != nil {
			if ctx.Err() == nil {
				klog.FromContext(ctx).V(2).Info("Forwarder stopped", "address", l.Addr().String(), "err", err)
			}
			return
		}
		go func() {
			defer in.Close()
			out, err := dial(ctx)
			if err != nil {
				klog.FromContext(ctx).V(3).Info("Forward: dial", "err", err)
				return
			}
			defer out.Close()
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(out, in); CloseWrite(out) }()
			go func() { defer wg.Done(); _, _ = io.Copy(in, out); CloseWrite(in) }()
			wg.Wait()
		}()
	}
}

// CloseWrite half-closes c where it can (a TCP or unix connection), so that
// the far side reads the end of what was copied to it.
func CloseWrite(c net.Conn) {
	if tc, ok := c.(interface{ CloseWrite() error }); ok {
		_ = tc.CloseWrite()
	}
}

// NetnsOf is the network namespace of a process.
func NetnsOf(pid int) string { return fmt.Sprintf("/proc/%d/ns/net", pid) }
